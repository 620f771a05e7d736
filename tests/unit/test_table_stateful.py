"""A model-based test of one ``SparseTable``'s whole state machine (``hypothesis.stateful``).

A real table, with a RAM tier of a few rows spilling to a real RocksDB store in a temporary directory
and an arena and index of 16 rows that grow, is driven through random sequences of pulls (with and
without ``init_missing``), pushes and GEO pushes (duplicate keys within a batch, with and without
shows and clicks), deletes, expiry passes (``shrink``), clock steps, ``release_ram`` / ``restore_ram``,
base saves (``rows(clear=True)``) and delta saves (``dirty_dump(clear=True)``) each loaded into a
replica the way the checkpoint reader loads them (``engine.checkpoint.reader``: ``bulk_load``,
``delta_load``, tombstones, ``finish_restore``), and restarts from that chain. Every observable result
is checked against a plain dict model written here from the docstrings:

- values and optimizer state: the optimizer rules of ``sparse_tables._optimizers``' docstring computed
  in float64 (each stored word rounded to float32, as the row stores it), compared at float32
  tolerance; show, click and last_seen exactly;
- which keys have rows (``contains``, ``len``, ``stats()["rows"]``), admission decisions (count-min
  counts of occurrences, the probabilistic admission as a function of seed, key and count),
  ``max_rows`` refusals and their counters;
- what an expiry pass deletes (decayed show/click score, ``expire_after``) and returns;
- what a delta holds: exactly the rows changed since the last save, each with ``existed``, and the
  tombstones (keys the last save held that have no row now); a replica restored from base + deltas
  equals the table bit for bit.

Keys at the edges are in every universe: 0, 2**64-1 (also the index's EMPTY slot word), 0xFFFFFFFF (the
arena's end-of-free-list word), 2**32, 2**63, and the keys whose index hash is all ones and all zeros
(a slot of the key whose hash is all ones is EMPTY's fingerprint half).

``make test`` runs a short profile (a few seconds); ``make test-long`` a longer one.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_tables import SparseTable, TableConfig
from sparse_tables.rows import EXISTED_NO, EXISTED_YES
from tests import naive
from tests.naive import f32, initial_state, optimizer_step

M64 = (1 << 64) - 1
# the spill stores live in RAM where it can (tmpfs: RocksDB's opens, option changes and closes, dozens per
# example, take a third of the time they take on a disk); a real RocksDB either way
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
INDEX_SALT = 0x5BD1E9955BD1E995
ADMIT_SALT = 0xA0761D6478BD642F


# ------------------------------------------------------------------------------ reference hashing
def _unxorshift(x: int, s: int) -> int:
    y = x
    for _ in range(64 // s + 1):
        y = x ^ (y >> s)
    return y & M64


def _inverse_fmix64(h: int) -> int:
    """The key x with MurmurHash3's fmix64(x) == h (fmix64 is a bijection)."""
    x = _unxorshift(h, 33)
    x = (x * pow(0xC4CEB9FE1A85EC53, -1, 1 << 64)) & M64
    x = _unxorshift(x, 33)
    x = (x * pow(0xFF51AFD7ED558CCD, -1, 1 << 64)) & M64
    return _unxorshift(x, 33)


def _key_with_index_hash(h: int) -> int:
    return _inverse_fmix64(h) ^ INDEX_SALT


EDGE_KEYS = [0, 1, M64, M64 - 1, 0xFFFFFFFF, 1 << 32, 1 << 63, _key_with_index_hash(M64), _key_with_index_hash(0)]
UNIVERSE = np.array(EDGE_KEYS + np.random.default_rng(11).integers(0, 1 << 64, 31, dtype=np.uint64,
                                                                   endpoint=False).tolist(), np.uint64)
assert len(set(UNIVERSE.tolist())) == len(UNIVERSE)


# ------------------------------------------------------------------------------ configurations
# Each spills to RocksDB past a few rows in RAM (but the RAM-only one), starts with 16 arena rows and
# 32 index slots (initial_rows=4) so growth happens, and names the optimizer, eviction and admission
# it exercises. Bounds and decays are exact binary fractions; FTRL's l1 is 0 (its |z| <= l1 cut would
# turn float32 rounding into a jump).
CONFIGS = {
    "adagrad_lru_expiry": dict(dim=3, optimizer="adagrad", initial_accumulator=0.1, memory_rows=6,
                               eviction="lru", expire_after=30.0, delete_threshold=0.3,
                               show_click_decay=0.5, spill=True),
    "adam_slru_admission": dict(dim=9, optimizer="adam", memory_rows=5, min_count=2, admit_probability=0.6,
                                sketch_width=4096, delete_threshold=0.15, show_click_decay=0.75,
                                spill=True),
    "ftrl_bounds": dict(dim=4, optimizer="ftrl", ftrl_l2=0.1, initializer="zeros", memory_rows=8,
                        min_bound=-0.25, max_bound=0.25, spill_low_watermark=0.5, expire_after=50.0,
                        spill=True),
    "std_adagrad_normal": dict(dim=2, optimizer="std_adagrad", initializer="normal", init_range=0.1,
                               memory_rows=4, min_count=3, sketch_width=4096, show_click_decay=0.5,
                               delete_threshold=0.5, spill=True),
    "sgd_ram_max_rows": dict(dim=8, optimizer="sgd", max_rows=20, min_count=2, sketch_width=4096,
                             expire_after=40.0, spill=False),
}


def make_config(name: str, spill_path: str | None) -> TableConfig:
    params = dict(CONFIGS[name])
    spill = params.pop("spill")
    params.setdefault("init_range", 0.05)
    return TableConfig(learning_rate=0.1, seed=5, num_threads=1,
                       spill_path=spill_path if spill else None, **params)


# ------------------------------------------------------------------------------ the model
class Row:
    __slots__ = ("w", "s", "show", "click", "seen")

    def __init__(self, w, s, show, click, seen):
        self.w, self.s, self.show, self.click, self.seen = w, s, show, click, seen


class Model:
    """The table as a dict: key -> Row, the admission counts of keys without a row, and what the next
    delta must hold (``dirty``: keys changed since the last save; ``parent``: keys at the last save)."""

    def __init__(self, cfg: TableConfig):
        self.cfg = cfg
        self.rows: dict[int, Row] = {}
        self.counts: dict[int, int] = {}
        self.dirty: set[int] = set()
        self.parent: set[int] = set()
        self.created = self.rejected = self.refused = 0

    @property
    def admission(self) -> bool:
        return self.cfg.min_count > 1 or self.cfg.admit_probability < 1

    def pull(self, keys, init_missing: bool) -> np.ndarray:
        out = np.zeros((len(keys), self.cfg.dim), np.float32)
        for i, k in enumerate(keys):
            if k in self.rows:
                out[i] = self.rows[k].w
            elif init_missing and not self.admission:
                out[i] = naive.initial_values(self.cfg, k)
        return out

    def _admit(self, key: int, inc: int) -> bool:
        cfg = self.cfg
        if not self.admission:
            return True
        c = min(self.counts.get(key, 0) + inc, 0xFFFFFFFF)
        self.counts[key] = c
        if c < cfg.min_count:
            return False
        return cfg.admit_probability >= 1 or \
            naive.uniform01((cfg.seed % (1 << 64)) ^ ADMIT_SALT, key, c) < cfg.admit_probability

    def push(self, keys, grads, shows, clicks, now: int, delta: bool) -> None:
        """Duplicates merged first (gradients, shows, clicks summed in float32 in occurrence order: the
        push docstring, and Paddle's merge of a batch's duplicate keys), then applied once per key."""
        merged: dict[int, list] = {}
        for i, k in enumerate(keys):
            if k not in merged:
                merged[k] = [grads[i].copy(), 0, f32(0), f32(0)]
            else:
                merged[k][0] = f32(merged[k][0] + grads[i])
            merged[k][1] += 1
            if shows is not None:
                merged[k][2] = f32(merged[k][2] + shows[i])
                merged[k][3] = f32(merged[k][3] + clicks[i])
        cfg = self.cfg
        for k, (g, copies, show, click) in merged.items():
            if k not in self.rows:
                if cfg.max_rows and len(self.rows) >= cfg.max_rows:
                    self.refused += 1          # refused as not admitted: no count in the sketch
                    continue
                occurrences = int(float(show) + 0.5) if shows is not None and show >= 1 else copies
                if not self._admit(k, occurrences):
                    self.rejected += 1
                    continue
                self.rows[k] = Row(naive.initial_values(cfg, k), initial_state(cfg), f32(0), f32(0), now)
                self.created += 1
            row = self.rows[k]
            if delta:
                row.w = f32(np.clip(f32(row.w + g), cfg.min_bound, cfg.max_bound))
            else:
                scale = 1.0 / float(show) if shows is not None and show > 0 else 1.0
                row.w, row.s = optimizer_step(cfg, row.w, row.s, g, scale)
            if shows is not None:
                row.show = f32(row.show + show)
                row.click = f32(row.click + click)
            else:
                row.show = f32(row.show + f32(copies))
            row.seen = now
            self.dirty.add(k)

    def shrink(self, now: int) -> set[int]:
        cfg = self.cfg
        decay = f32(cfg.show_click_decay)
        dead = set()
        for k, row in self.rows.items():
            row.show = f32(row.show * decay)
            row.click = f32(row.click * decay)
            score = (float(row.show) - float(row.click)) * cfg.nonclk_coeff + float(row.click) * cfg.click_coeff
            if score < cfg.delete_threshold or (cfg.expire_after is not None
                                                and now - row.seen > int(cfg.expire_after)):
                dead.add(k)
            elif cfg.show_click_decay != 1.0:
                self.dirty.add(k)
        for k in dead:
            del self.rows[k]
        self.counts = {k: c >> 1 for k, c in self.counts.items()}
        return dead

    def delete(self, keys) -> int:
        gone = {k for k in keys if k in self.rows}
        for k in gone:
            del self.rows[k]
        return len(gone)

    def saved(self) -> None:
        """A save cleared the dirty state: the next delta is relative to the rows now."""
        self.dirty = set()
        self.parent = set(self.rows)


# ------------------------------------------------------------------------------ dumps
def dump_of(batches, dim: int) -> dict[int, tuple]:
    """key -> (values f32[dim], state f32[w], show, click, last_seen, existed or None); a key twice fails."""
    out = {}
    for b in batches:
        keys = b.column("key").to_numpy()
        vals = b.column("values").flatten().to_numpy().reshape(len(keys), dim)
        if "state" in b.schema.names:
            state = b.column("state").flatten().to_numpy().reshape(len(keys), -1)
        else:
            state = np.zeros((len(keys), 0), np.float32)
        show, click = b.column("show").to_numpy(), b.column("click").to_numpy()
        seen = b.column("last_seen").to_numpy()
        existed = b.column("existed").to_numpy() if "existed" in b.schema.names else None
        for i, k in enumerate(keys.tolist()):
            assert k not in out, f"key {k} dumped twice"
            out[k] = (vals[i], state[i], show[i], click[i], int(seen[i]),
                      None if existed is None else int(existed[i]))
    return out


def bits_of(dump: dict) -> dict:
    """A dump's rows as bytes (bit-exact comparison), ``existed`` left out."""
    return {k: (v[0].tobytes(), v[1].tobytes(), f32(v[2]).tobytes(), f32(v[3]).tobytes(), v[4])
            for k, v in dump.items()}


RTOL, ATOL = 2e-5, 2e-6


def assert_row_matches(key: int, got: tuple, want: Row, what: str) -> None:
    np.testing.assert_allclose(got[0], want.w, rtol=RTOL, atol=ATOL, err_msg=f"{what}: values of key {key}")
    np.testing.assert_allclose(got[1], want.s, rtol=RTOL, atol=ATOL, err_msg=f"{what}: state of key {key}")
    assert (float(got[2]), float(got[3]), got[4]) == (float(want.show), float(want.click), want.seen), \
        f"{what}: show/click/last_seen of key {key}: {got[2:5]} != {(want.show, want.click, want.seen)}"


# ------------------------------------------------------------------------------ the machine
key_lists = st.lists(st.integers(0, len(UNIVERSE) - 1), min_size=0, max_size=14)


class TableMachine(RuleBasedStateMachine):
    """One table, its model, and a replica restored from its saves (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="table-stateful-", dir=SCRATCH)
        self.now = 1000
        self.serial = 0
        self.t: SparseTable | None = None
        self.replica: SparseTable | None = None
        self.chain: list = []          # [(kind, uri, batches, tombstones)] since the last base
        self.at_save: dict = {}       # the model's rows at the last save
        self.released = False

    # -------------------------------------------------------------------------- helpers
    def _clock(self) -> float:
        return float(self.now)

    def _path(self) -> str:
        self.serial += 1
        return f"{self.tmp}/spill-{self.serial}"

    def _table(self) -> SparseTable:
        return SparseTable(make_config(self.name, self._path()), clock=self._clock, initial_rows=4)

    def _restore(self, chain) -> SparseTable:
        """A fresh table restored from ``chain`` (a base and its deltas) as ``engine.checkpoint.reader``
        restores a checkpoint."""
        t = self._table()
        try:
            parent = None
            for kind, uri, batches, tombstones in chain:
                if kind == "base":
                    with t.bulk_load(distinct=True):
                        t.load_rows(iter(batches))
                    exact = t.finish_restore(uri)
                else:
                    with t.delta_load(parent) as trusted:      # tombstones first, as the reader
                        if len(tombstones):
                            t.delete(tombstones, tombstones=True, at_parent=True)
                        t.load_rows(iter(batches))
                    exact = t.finish_restore(uri)
                    # a table that spills and holds exactly the parent takes existed as true
                    assert trusted == (t._spill is not None), (uri, trusted)
                assert exact == (t._spill is not None), (uri, exact)
                parent = uri
        except BaseException:
            t.close()
            raise
        return t

    def _keys(self, idx) -> np.ndarray:
        return UNIVERSE[np.asarray(idx, np.int64)] if len(idx) else np.empty(0, np.uint64)

    def _counters_match(self) -> None:
        s = self.t.stats()
        assert (s["created"], s["rejected"], s["rows_refused_full"]) == \
            (self.m.created, self.m.rejected, self.m.refused), \
            (s["created"], s["rejected"], s["rows_refused_full"], self.m.created, self.m.rejected, self.m.refused)

    # -------------------------------------------------------------------------- rules
    @initialize(name=st.sampled_from(sorted(CONFIGS)))
    def setup(self, name):
        self.name = name
        self.cfg = make_config(name, self._path())
        self.m = Model(self.cfg)
        self.t = self._table()
        self.at_save = {}

    @rule(idx=key_lists, init_missing=st.booleans(), part=st.booleans())
    def pull(self, idx, init_missing, part):
        keys = self._keys(idx)
        want = self.m.pull(keys.tolist(), init_missing)
        if part:    # a server's shard fills its positions of a shared reply (``rows``), and no others
            rows = np.arange(0, len(keys), 2, dtype=np.int64)
            out = np.full((len(keys), self.cfg.dim), 7.0, np.float32)
            self.t.pull(keys, init_missing=init_missing, out=out, rows=rows)
            want[1::2] = 7.0
            got = out
        else:
            got = self.t.pull(keys, init_missing=init_missing)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"pull {keys.tolist()}")

    @rule(idx=key_lists, seed=st.integers(0, 2**16), with_shows=st.booleans(), delta=st.booleans())
    def push(self, idx, seed, with_shows, delta):
        keys = self._keys(idx)
        rng = np.random.default_rng(seed)
        grads = (rng.standard_normal((len(keys), self.cfg.dim)) * 0.5).astype(np.float32)
        shows = clicks = None
        if with_shows:
            shows = rng.integers(0, 4, len(keys)).astype(np.float32)
            clicks = np.minimum(shows, rng.integers(0, 2, len(keys))).astype(np.float32)
        if delta:
            self.t.push_delta(keys, grads, shows=shows, clicks=clicks)
        else:
            self.t.push(keys, grads, shows=shows, clicks=clicks)
        self.m.push(keys.tolist(), grads, shows, clicks, self.now, delta)
        self._counters_match()

    @rule(seed=st.integers(0, 2**16), n=st.integers(8, 24))
    def churn(self, seed, n):
        """A push of n distinct keys (most of the universe): past the RAM tier, so rows move to RocksDB
        and back, and (a fresh table) past the arena's and the index's first sizes."""
        rng = np.random.default_rng(seed)
        self.push(rng.choice(len(UNIVERSE), n, replace=False).tolist(), seed, bool(seed & 1), False)

    @rule(seconds=st.sampled_from([1, 7, 20, 31, 45]))
    def advance(self, seconds):
        self.now += seconds

    @rule()
    def shrink(self):
        deleted = self.t.shrink()
        dead = self.m.shrink(self.now)
        assert deleted == len(dead), (deleted, sorted(dead))

    @rule(idx=key_lists)
    def delete(self, idx):
        keys = self._keys(idx)
        assert self.t.delete(keys) == self.m.delete(set(keys.tolist()))

    @rule()
    def check_contents(self):
        """Every row (rows() without clear), and contains() of the whole universe."""
        got = dump_of(self.t.rows(chunk_rows=5), self.cfg.dim)
        assert sorted(got) == sorted(self.m.rows), (sorted(got), sorted(self.m.rows))
        for k, row in self.m.rows.items():
            assert_row_matches(k, got[k], row, "rows()")
        present = self.t.contains(UNIVERSE)
        assert present.tolist() == [k in self.m.rows for k in UNIVERSE.tolist()]

    @precondition(lambda self: self.cfg.spill_path is not None and not self.released)
    @rule()
    def release_ram(self):
        self.t.release_ram()
        self.released = True

    @precondition(lambda self: self.released)
    @rule()
    def restore_ram(self):
        self.t.restore_ram()
        self.released = False

    @rule()
    def base_save(self):
        """A base save, loaded into a fresh replica as a checkpoint restore does."""
        batches = list(self.t.rows(clear=True, chunk_rows=7))
        got = dump_of(batches, self.cfg.dim)
        assert sorted(got) == sorted(self.m.rows)
        for k, row in self.m.rows.items():
            assert_row_matches(k, got[k], row, "base")
        self.m.saved()
        self.at_save = copy.deepcopy(self.m.rows)
        self.serial += 1
        self.chain = [("base", f"mem://ckpt/{self.serial}", batches, np.empty(0, np.uint64))]
        if self.replica is not None:
            self.replica.close()
        self.replica = None
        self.replica = self._restore(self.chain)
        self._replica_equals_table()

    @precondition(lambda self: self.replica is not None)
    @rule()
    def delta_save(self):
        """A delta save: the rows changed since the last save (each with ``existed``) and the tombstones;
        applied to the replica, which then equals the table."""
        dump = self.t.dirty_dump(clear=True, chunk_rows=3)
        try:
            batches, tombstones = list(dump), dump.deleted
        finally:
            dump.close()
        got = dump_of(batches, self.cfg.dim)
        want_keys = self.m.dirty & set(self.m.rows)
        assert sorted(got) == sorted(want_keys), ("delta rows", sorted(got), sorted(want_keys))
        for k in want_keys:
            assert_row_matches(k, got[k], self.m.rows[k], "delta")
            want_existed = EXISTED_YES if k in self.m.parent else EXISTED_NO
            assert got[k][5] == want_existed, ("existed", k, got[k][5])
        assert tombstones.tolist() == sorted(self.m.parent - set(self.m.rows)), \
            ("tombstones", tombstones.tolist(), sorted(self.m.parent - set(self.m.rows)))
        self.m.saved()
        self.at_save = copy.deepcopy(self.m.rows)
        self.serial += 1
        uri = f"mem://ckpt/{self.serial}"
        parent = self.chain[-1][1]
        self.chain.append(("delta", uri, batches, tombstones))
        with self.replica.delta_load(parent) as trusted:      # tombstones first, as the reader
            if len(tombstones):
                self.replica.delete(tombstones, tombstones=True, at_parent=True)
            self.replica.load_rows(iter(batches))
        assert trusted == (self.cfg.spill_path is not None)
        self.replica.finish_restore(uri)
        self._replica_equals_table()

    @precondition(lambda self: self.replica is not None)
    @rule()
    def restart(self):
        """The process restarts from its last checkpoint: the replica (restored base + deltas, one at a
        time) becomes the table, what was trained since the last save is gone, and so are the admission
        counts (the count-min sketch is not checkpointed); a new replica is restored from the chain in one go."""
        old, self.t = self.t, self.replica
        old.close()
        self.released = False
        self.replica = None
        self.m.rows = copy.deepcopy(self.at_save)
        self.m.counts = {}
        self.m.dirty = set()
        self.m.parent = set(self.m.rows)
        self.m.created = self.m.rejected = self.m.refused = 0
        self.replica = self._restore(self.chain)
        self._replica_equals_table()

    def _replica_equals_table(self) -> None:
        mine = bits_of(dump_of(self.t.rows(), self.cfg.dim))
        theirs = bits_of(dump_of(self.replica.rows(), self.cfg.dim))
        assert sorted(mine) == sorted(theirs), ("replica keys", sorted(mine), sorted(theirs))
        for k in mine:
            assert mine[k] == theirs[k], ("replica row", k)
        assert len(self.replica) == len(self.t) == len(self.m.rows)
        s = self.replica.stats()
        assert s["rows"] == len(self.m.rows)
        if self.cfg.spill_path is not None:     # a load leaves the RAM tier within its cap too
            assert s["rows_in_ram"] <= self.cfg.memory_rows, s["rows_in_ram"]

    # -------------------------------------------------------------------------- invariants
    @invariant()
    def sizes_agree(self):
        if self.t is None:
            return
        n = len(self.m.rows)
        s = self.t.stats()
        assert len(self.t) == n == s["rows"], (len(self.t), n, s["rows"])
        assert s["rows_in_ram"] + s["rows_spilled"] == n
        if self.cfg.spill_path is not None:
            assert s["rows_in_ram"] <= (0 if self.released else self.cfg.memory_rows), s["rows_in_ram"]
        if self.cfg.max_rows:
            assert n <= self.cfg.max_rows

    def teardown(self):
        for t in (self.t, self.replica):
            if t is not None:
                t.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


SHORT = settings(max_examples=30, stateful_step_count=30, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
LONG = settings(max_examples=200, stateful_step_count=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class TestTableStateMachine(TableMachine.TestCase):
    settings = SHORT


@pytest.mark.long
class TestTableStateMachineLong(TableMachine.TestCase):
    settings = LONG
