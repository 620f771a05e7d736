"""Role mode's check of the CTR inputs (``engine.programs.ctr_inputs``) on real files: each worker's share
finds what the launcher's check finds, named alike, and the workers' verdict (threads over an in-memory
stand-in of the servers' accumulators and barrier) is the first bad value in reading order, on every
worker."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from engine.program_configs import DataConfig
from engine.programs import ctr_inputs
from engine.programs.ctr_data import check_train_split, expected_schema, file_rows
from engine.programs.ctr_eval import check_test_split
from streaming.criteo import convert_criteo, generate_criteo
from streaming.errors import DataFormatError, SchemaError

SLOTS = ["C1", "C2"]
SCHEMA = expected_schema(SLOTS, 13)
WORKERS = 3


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """400 generated lines: 320 train rows in 4 files of 80, and 80 test rows in 2 files of 40."""
    d = tmp_path_factory.mktemp("criteo")
    generate_criteo(d / "rows.txt", 400, 3)
    for split in ("train", "test"):
        convert_criteo([d / "rows.txt"], d / f"{split}-one", split=split, batch_size=16)
    for split, n in (("train", 4), ("test", 2)):
        t = _read(d / f"{split}-one")
        (d / split).mkdir()
        for i in range(n):
            _write(d / split / f"part-{i}.arrow", t.slice(i * t.num_rows // n, t.num_rows // n))
    return d


def _read(d):
    return pa.concat_tables(pa.ipc.open_stream(str(f)).read_all() for f in sorted(d.glob("*.arrow")))


def _write(path, table):
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=16)


def _spoil(src, dst, row: int, column: str = "label"):
    """Copy the Arrow file ``src`` to ``dst`` with row ``row`` (0-based) of ``column`` bad (label 3.0, or null)."""
    t = pa.ipc.open_stream(str(src)).read_all()
    i = t.schema.get_field_index(column)
    if column == "label":
        v = t.column(i).to_numpy().copy()
        v[row] = 3.0
        col = pa.array(v, pa.float32())
    else:
        v = t.column(i).to_pylist()
        v[row] = None
        col = pa.array(v, t.schema.field(i).type)
    _write(dst, t.set_column(i, t.schema.field(i), col))


def _copy(criteo, tmp_path, spoil: dict):
    """train/ and test/ under tmp_path, with ``spoil[(split, file)] = row`` labels made bad."""
    for split, n in (("train", 4), ("test", 2)):
        (tmp_path / split).mkdir()
        for i in range(n):
            src, dst = criteo / split / f"part-{i}.arrow", tmp_path / split / f"part-{i}.arrow"
            if (split, i) in spoil:
                _spoil(src, dst, spoil[(split, i)])
            else:
                dst.write_bytes(src.read_bytes())
    return DataConfig(source="arrow", train_path=str(tmp_path / "train"), test_path=str(tmp_path / "test"))


def _shares(data, spoilt_rank=None):
    """Every worker's check_shard -> {rank: rows or the error}."""
    out = {}
    for w in range(WORKERS):
        try:
            out[w] = ctr_inputs.check_shard(data, SCHEMA, w, WORKERS, file_rows(data.train_path))
        except (DataFormatError, SchemaError) as e:
            out[w] = e
    return out


def test_the_shares_read_every_row_once_and_only_the_share_holding_a_bad_label_names_it_as_the_launcher(
        criteo, tmp_path):
    clean = _shares(DataConfig(source="arrow", train_path=str(criteo / "train"), test_path=str(criteo / "test")))
    assert sum(r[0] for r in clean.values()) == 320 and sum(r[1] for r in clean.values()) == 80
    data = _copy(criteo, tmp_path, {("train", 3): 70})       # row 310 of the rows: the last share's (213..319)
    with pytest.raises(DataFormatError) as launcher:
        check_train_split(data.train_path, SCHEMA)
    shares = _shares(data)
    assert [isinstance(shares[w], DataFormatError) for w in range(WORKERS)] == [False, False, True]
    assert str(shares[2]) == str(launcher.value)
    assert str(launcher.value).endswith("part-3.arrow: row 71: field label: expected a label in [0, 1], got 3.0")


def test_a_test_split_share_finds_a_null_group_id_as_the_launcher(criteo, tmp_path):
    data = _copy(criteo, tmp_path, {})
    data = DataConfig(source="arrow", train_path=data.train_path, test_path=data.test_path, group_column="C2")
    _spoil(criteo / "test" / "part-1.arrow", tmp_path / "test" / "part-1.arrow", 5, column="C2")
    with pytest.raises(DataFormatError) as launcher:
        check_test_split(data, SCHEMA)
    shares = _shares(data)
    found = [w for w in range(WORKERS) if isinstance(shares[w], DataFormatError)]
    # 2 files for 3 workers: record batches w::3 of the split; part-1's first is the split's 4th: worker 0's
    assert found == [0] and str(shares[0]) == str(launcher.value)
    assert "row 6: field C2: expected a group id" in str(launcher.value)


@pytest.mark.parametrize("error", [
    DataFormatError("/d/train/part-1.arrow", 7, "dense", "expected a finite value, got nan", unit="row"),
    SchemaError("/d/test/part-0.arrow", "C1", "uint64", "double", present=("label", "C1")),
])
def test_an_error_travels_through_the_counts_unchanged(error):
    files = (["/d/train/part-0.arrow", "/d/train/part-1.arrow"], ["/d/test/part-0.arrow"])
    counts = ctr_inputs.encode(error, files)
    assert counts.dtype == np.int64 and counts.ndim == 1
    key, back = ctr_inputs.decode(counts)
    assert type(back) is type(error) and str(back) == str(error)
    assert key == ((0, 1, 7) if isinstance(error, DataFormatError) else (1, 0, 0))


def test_a_very_long_reason_is_cut_to_the_bound_and_keeps_its_start():
    error = DataFormatError("/d/train/part-0.arrow", 3, "label", "expected a label, got " + "9" * 100_000, unit="row")
    counts = ctr_inputs.encode(error, (["/d/train/part-0.arrow"], []))
    assert counts.nbytes <= ctr_inputs.MAX_DESCRIPTION_BYTES + 64
    key, back = ctr_inputs.decode(counts)
    assert key == (0, 0, 3) and str(back).startswith(str(error)[:200]) and str(back).endswith("...")


class _Servers:
    """The servers' accumulators and barrier as the workers' threads see them (the PS client's calls)."""

    def __init__(self, workers: int):
        self.acc, self.lock, self.barrier = {}, threading.Lock(), threading.Barrier(workers, timeout=30)

    def add_metric(self, name, counts, sums):
        with self.lock:
            c, s = self.acc.get(name, (np.zeros_like(counts), np.zeros_like(sums)))
            self.acc[name] = (c + counts, s + sums)

    def read_metric(self, name):
        with self.lock:
            return self.acc.get(name, (np.zeros(0, np.int64), np.zeros(0, np.float64)))


def _on_workers(check, trainer) -> tuple[dict, dict]:
    """``check(trainer(w, servers))`` on WORKERS threads sharing one stand-in of the servers -> ({rank: None
    or the error it raised}, the accumulators)."""
    servers, out = _Servers(WORKERS), {}

    def run(w):
        try:
            check(trainer(w, servers))
            out[w] = None
        except Exception as e:      # noqa: BLE001 - what each worker ends with
            out[w] = e
    threads = [threading.Thread(target=run, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, servers.acc


def _verdicts(data, monkeypatch) -> tuple[dict, dict]:
    """check_before_training on WORKERS threads -> ({rank: None or the error it raised}, the accumulators)."""
    monkeypatch.delenv("ENGINE_PARENT_PID", raising=False)
    rows = file_rows(data.train_path)
    return _on_workers(ctr_inputs.check_before_training, lambda w, servers: SimpleNamespace(
        storage_options=None, cfg=SimpleNamespace(metrics_table="metrics", data=data), schema=SCHEMA, rank=w,
        num_workers=WORKERS, client=servers, file_rows=rows,
        mode=SimpleNamespace(barrier=lambda name: servers.barrier.wait())))


def test_every_worker_ends_with_the_first_bad_value_in_reading_order(criteo, tmp_path, monkeypatch):
    """Three workers find a bad value: worker 0 in the test split (part-0 row 4: the split's first record
    batch), worker 1 in train part-1 (row 45: row 124 of the rows, its share is 106..212) and worker 2 in
    train part-3. Every worker raises worker 1's, the first in reading order (train before test), which
    is the launcher's."""
    data = _copy(criteo, tmp_path, {("train", 1): 44, ("train", 3): 70, ("test", 0): 3})
    with pytest.raises(DataFormatError) as launcher:
        check_train_split(data.train_path, SCHEMA)
    out, acc = _verdicts(data, monkeypatch)
    assert acc["metrics.input-check"][0].tolist() == [1, 1, 1]
    assert sorted(out) == list(range(WORKERS))
    assert all(isinstance(e, DataFormatError) and str(e) == str(launcher.value) for e in out.values()), out
    assert "part-1.arrow: row 45: field label" in str(launcher.value)


def test_clean_inputs_pass_and_a_launchers_child_does_not_check(criteo, tmp_path, monkeypatch):
    out, acc = _verdicts(DataConfig(source="arrow", train_path=str(criteo / "train"), test_path=str(criteo / "test")),
                         monkeypatch)
    assert out == dict.fromkeys(range(WORKERS)) and list(acc) == ["metrics.input-check"]
    assert acc["metrics.input-check"][0].tolist() == [0, 0, 0] and acc["metrics.input-check"][1].tolist() == [320, 80]
    monkeypatch.setenv("ENGINE_PARENT_PID", "1")
    data = _copy(criteo, tmp_path, {("train", 0): 0})
    t = SimpleNamespace(storage_options=None, cfg=SimpleNamespace(metrics_table="metrics", data=data),
                        schema=SCHEMA, rank=0, num_workers=1, client=None, mode=None, file_rows=file_rows(data.train_path))
    ctr_inputs.check_before_training(t)         # its launcher's prepare checked the inputs: nothing read


@pytest.mark.parametrize("differ", [None, 2])
def test_workers_whose_listings_differ_all_refuse_before_any_step(differ):
    """Each worker lists the train files itself when it starts: a file added or written between two
    workers' listings split the rows by other counts on each, silently. The digests of the listings
    meet at a barrier; a mismatch ends every worker with the same kind of error, naming the workers."""
    fp = [["part-0.arrow", 100, "0000abcd", "00000000"], ["part-1.arrow", 50, "1234abcd", "00000000"]]
    out, _ = _on_workers(ctr_inputs.agree_on_files, lambda w, servers: SimpleNamespace(
        cfg=SimpleNamespace(metrics_table="metrics", data=SimpleNamespace(train_path="/d/train")), rank=w,
        num_workers=WORKERS, client=servers,
        train_fingerprint=fp + [["part-2.arrow", 7, "ffffffff", "00000000"]] if w == differ else fp,
        mode=SimpleNamespace(barrier=lambda name: servers.barrier.wait())))
    assert sorted(out) == list(range(WORKERS))
    if differ is None:
        assert all(e is None for e in out.values())
        return
    from streaming.inputs import InputChangedError
    assert all(isinstance(e, InputChangedError) for e in out.values()), out
    assert str(out[0]).startswith("/d/train: row 1: field <listing>: expected every worker to list the same train "
                                  "files, got 1 of 3 workers (worker 2) listing other files than worker 0")


def test_a_check_failing_for_another_reason_ends_every_worker_at_the_barrier(criteo, tmp_path, monkeypatch):
    """A store that stopped answering while worker 1 read its share: it left before the barrier, and its
    peers waited there until client.barrier_timeout_s. Now it arrives (flag 2), raises its own error after
    the barrier, and the peers raise a LaunchError naming it; nothing was trained."""
    from engine.errors import LaunchError
    from streaming.inputs import InputUnavailableError
    data = _copy(criteo, tmp_path, {})
    real = ctr_inputs.check_shard

    def shard(data, schema, rank, *args, **kwargs):
        if rank == 1:
            raise InputUnavailableError("s3://b/train/part-1.arrow", "the store did not answer")
        return real(data, schema, rank, *args, **kwargs)
    monkeypatch.setattr(ctr_inputs, "check_shard", shard)
    out, acc = _verdicts(data, monkeypatch)
    assert acc["metrics.input-check"][0].tolist() == [0, 2, 0]
    assert isinstance(out[1], InputUnavailableError)
    for w in (0, 2):
        assert isinstance(out[w], LaunchError) and str(out[w]).startswith(
            "worker 1: the check of its share of the inputs failed before training (not bad data"), out[w]
