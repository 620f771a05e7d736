"""A PS client that pushes and pulls in a loop and logs every call, run on a test host by
``test_partition.py``::

    python -m tests.partition_client CONFIG.yaml ENDPOINT OUT.jsonl STOP_FILE [--max-s S]

The client is made as a worker's is (``engine.connect`` with the config's client settings). Each round
pushes a gradient of ones for ``KEYS`` (SGD, learning rate 1: a push applied once lowers every row by
exactly 1) and pulls them back. Every call is one JSON line in OUT: ``op``, ``t0`` and ``t1`` (wall
clock, seconds), ``ok``, and on failure the error's type and message. When STOP_FILE exists (or after
``--max-s`` seconds) a last line ``{"op": "final", "rows": [...]}`` gives the first column of the
rows, read with a fresh client, or the error that read met.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from engine.config import load_config
from engine.connect import connect

KEYS = np.arange(1, 65, dtype=np.uint64) * np.uint64(2654435761)
TABLE = "emb"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("endpoint")
    ap.add_argument("out")
    ap.add_argument("stop_file")
    ap.add_argument("--max-s", type=float, default=120.0)
    a = ap.parse_args()
    cfg = load_config(a.config)
    end = time.monotonic() + a.max_s
    with open(a.out, "a") as out, connect(cfg, [a.endpoint], name="partition-client", admin=False) as c:
        def log(rec: dict) -> None:
            out.write(json.dumps(rec) + "\n")
            out.flush()

        dim = c.sparse_dim(TABLE)
        while time.monotonic() < end and not os.path.exists(a.stop_file):
            for op in ("push", "pull"):
                t0 = time.time()
                try:
                    if op == "push":
                        c.push(TABLE, KEYS, np.ones((len(KEYS), dim), np.float32))
                    else:
                        c.pull(TABLE, KEYS, init_missing=True)
                    log({"op": op, "t0": t0, "t1": time.time(), "ok": True})
                except Exception as e:  # noqa: BLE001 - every outcome is the record
                    log({"op": op, "t0": t0, "t1": time.time(), "ok": False, "error": type(e).__name__,
                         "message": str(e)[:400]})
            time.sleep(0.1)
        try:
            with connect(cfg, [a.endpoint], name="partition-reader", admin=False) as r:
                log({"op": "final", "rows": r.pull(TABLE, KEYS, init_missing=False)[:, 0].tolist()})
        except Exception as e:  # noqa: BLE001
            log({"op": "final", "error": type(e).__name__, "message": str(e)[:400]})


if __name__ == "__main__":
    main()
