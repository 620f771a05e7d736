"""``streaming.inputs``' errors carry what happened apart from a training job's advice, so each command words
its own context. Before, ``engine predict`` rewrote the training wording by string (``str(e).replace(CHANGED,
...)``, ``str(e).removeprefix("training input ")``), ``engine eval`` printed the training advice (its row
split, ``--resume``) as it was, and a pickled error (a worker's, across processes) came back as a plain
``DataFormatError`` / without its ``refused``. ``engine train``'s wording is the same as before."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pyarrow as pa
import pytest

from streaming.inputs import CHANGED, InputChangedError, InputUnavailableError, input_error
from streaming.source import read_batches


def _write(path, n: int = 1000) -> None:
    t = pa.table({"label": pa.array(np.zeros(n, np.float32)), "C1": pa.array(np.arange(n, dtype=np.uint64))})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t, max_chunksize=100)


def test_a_changed_input_carries_its_fact_and_the_training_advice_apart(tmp_path):
    path = tmp_path / "part-0.arrow"
    _write(path)
    it = read_batches(str(path))
    next(it)
    os.utime(path, ns=(1, 1))           # another modification time: another version
    with pytest.raises(InputChangedError) as info:
        list(it)
    e = info.value
    head = f"{path}: row 101: field <record batch 1>: "
    # engine train's message, as before: the fact, then the training advice
    assert str(e) == f"{head}{e.fact}: {CHANGED}" and e.advice == CHANGED
    assert e.fact.startswith("expected the file the read began on (") and CHANGED not in e.fact
    assert e.advised("run it again") == f"{head}{e.fact}: run it again"
    assert e.advised(None) == f"{head}{e.fact}"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is InputChangedError and str(back) == str(e) and back.fact == e.fact
    assert back.advised("x") == e.advised("x")


def test_a_deleted_input_keeps_its_semicolon_before_the_advice():
    e = InputChangedError("s3://b/k", "expected the object as the job listed it (5 bytes), got none: deleted",
                          advice=CHANGED, sep="; ")
    assert str(e) == f"s3://b/k: row 1: field <object version>: expected the object as the job listed it (5 bytes), " \
                     f"got none: deleted; {CHANGED}"
    assert e.advised("other").endswith("got none: deleted; other")


def test_an_unavailable_input_carries_its_uri_reason_and_refusal_across_processes():
    e = input_error("s3://b/train/part-0.arrow", PermissionError(13, "Access Denied"))
    assert isinstance(e, InputUnavailableError)
    assert str(e) == f"training input s3://b/train/part-0.arrow: {e.reason}"       # engine train's wording
    assert e.uri == "s3://b/train/part-0.arrow" and e.reason.startswith("access refused (") and e.refused == "EACCES"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is InputUnavailableError and str(back) == str(e)
    assert (back.uri, back.reason, back.refused) == (e.uri, e.reason, "EACCES")
