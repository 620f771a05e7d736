"""The spill tier's per-key questions at one shard's size at 100M keys, each against the code it replaced.

1. "May this key be on disk?": the spill store's Bloom filter, the blocked chain against the classic one.
2. "Was this row evicted while dirty?": ``keysets.SortedKeySet.contains`` over the spilled dirty keys
   (asked for every row read back from RocksDB), lockstep binary searches against numpy's searchsorted.

Deliberate, never in CI. Every pull and push of a budgeted table asks its spill stores' filter
(``sparse_tables.keysets.ScalableBloom``) which keys may be on disk; a py-spy profile of ``scale_bench``'s
server at 80-95M keys put 11% of its busy samples there when the filter was a chain of classic Bloom
filters (Kirsch & Mitzenmacher double hashing, 7 probes anywhere in a filter, a 64-bit modulo each, one
pass over the keys per filter). This bench measures both on the same keys in the same run: the
classic chain (the filter as it was until the eighteenth session, kept here as the reference) and
today's blocked chain (one 64-byte block per key per filter, prefetched).

``--keys`` (25M: one of 4 shards at 100M keys) random keys are added in batches of 25,000 (as the
store adds evicted rows), from an initial capacity of 2^20 doubling, so both chains hold the same
filters. Then ``--queries`` absent keys and as many present ones are asked, in calls of ``--batch``
keys (a pull's unique keys per shard). One ``bloom`` row per filter::

    filter                 "blocked" or "classic"
    filters                filters in the chain
    bytes_per_key          the chain's bytes / keys added
    add_ns_per_key         adding, per key
    absent_ns_per_key      a query of keys never added (they pass through every filter), per key
    present_ns_per_key     a query of added keys, per key
    false_positive_rate    of the absent keys, the share answered "maybe"

and a ``bloom_summary`` row with ``absent_speedup`` and ``present_speedup`` (classic ns / blocked ns,
the same run) and both false-positive rates.

Then ``--dirty-keys`` (22M: one shard's spilled dirty keys at 100M keys when no delta has cleared them)
random keys go into a ``SortedKeySet`` in batches of 20,000 (an eviction pass's dirty rows), and sorted
calls of ``--dirty-batch`` keys (a pull's promotions on one shard; half of them members) ask it. One
``dirty_keys`` row: ``runs``, ``ns_per_key`` (today's ``contains``), ``numpy_ns_per_key`` (the same
runs through ``np.searchsorted``, as until the eighteenth session) and ``speedup``.

    python bench/keyset_bench.py [--keys 25000000] [--queries 2000000] [--batch 25000] [--repeat 3]
                                 [--dirty-keys 22000000] [--dirty-batch 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparse_tables._kernels import fmix64  # noqa: E402
from sparse_tables.keysets import ScalableBloom, SortedKeySet  # noqa: E402

U64 = np.uint64
_H1 = np.uint64(0x2545F4914F6CDD1D)
_H2 = np.uint64(0x9FB21C651E98DF25)


@njit(nogil=True, cache=True)
def _classic_add(bits, nhash, keys):
    nbits = U64(bits.shape[0] * 64)
    for i in range(keys.shape[0]):
        h1 = fmix64(keys[i] ^ _H1)
        h2 = fmix64(keys[i] ^ _H2) | U64(1)
        for j in range(nhash):
            b = (h1 + U64(j) * h2) % nbits
            bits[b >> U64(6)] |= U64(1) << (b & U64(63))


@njit(nogil=True, cache=True)
def _classic_query(bits, nhash, keys, out):
    nbits = U64(bits.shape[0] * 64)
    for i in range(keys.shape[0]):
        if out[i]:
            continue
        h1 = fmix64(keys[i] ^ _H1)
        h2 = fmix64(keys[i] ^ _H2) | U64(1)
        hit = True
        for j in range(nhash):
            b = (h1 + U64(j) * h2) % nbits
            if ((bits[b >> U64(6)] >> (b & U64(63))) & U64(1)) == U64(0):
                hit = False
                break
        out[i] = hit


class ClassicChain:
    """The reference: the spill store's filter until the eighteenth session (10 bits, 7 hashes per key
    anywhere in a filter, one pass per filter)."""

    def __init__(self, initial_capacity: int = 1 << 20, bits_per_key: int = 10, nhash: int = 7):
        self._bpk, self._nhash, self._next = bits_per_key, nhash, initial_capacity
        self._filters, self._caps, self._counts = [], [], []

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self._filters)

    def add(self, keys):
        start = 0
        while start < len(keys):
            if not self._filters or self._counts[-1] >= self._caps[-1]:
                self._filters.append(np.zeros((self._next * self._bpk + 63) // 64, U64))
                self._caps.append(self._next)
                self._counts.append(0)
                self._next *= 2
            chunk = keys[start:start + self._caps[-1] - self._counts[-1]]
            _classic_add(self._filters[-1], self._nhash, chunk)
            self._counts[-1] += len(chunk)
            start += len(chunk)

    def may_contain(self, keys):
        out = np.zeros(len(keys), np.bool_)
        for bits in self._filters:
            _classic_query(bits, self._nhash, keys, out)
        return out


def measure(name, make, keys, absent, present, batch, repeat):
    f = make()
    f.add(keys[:1000])                   # compile outside the clock
    f.may_contain(absent[:1000])
    f = make()
    t0 = time.perf_counter()
    for a in range(0, len(keys), 25_000):
        f.add(keys[a:a + 25_000])
    add_s = time.perf_counter() - t0

    def query(q):
        best, maybe = float("inf"), 0
        for _ in range(repeat):        # the best of repeat passes: the machine is shared
            maybe = 0
            t0 = time.perf_counter()
            for a in range(0, len(q), batch):
                maybe += int(np.count_nonzero(f.may_contain(q[a:a + batch])))
            best = min(best, time.perf_counter() - t0)
        return 1e9 * best / len(q), maybe

    absent_ns, fp = query(absent)
    present_ns, hits = query(present)
    if hits != len(present):
        raise SystemExit(f"{name}: {len(present) - hits} added keys not found (a false negative)")
    nfilters = len(getattr(f, "_starts", getattr(f, "_filters", [])))
    return {"bench": "bloom", "filter": name, "keys": len(keys), "filters": nfilters,
            "bytes_per_key": round(f.nbytes / len(keys), 3),
            "add_ns_per_key": round(1e9 * add_s / len(keys), 1),
            "absent_ns_per_key": round(absent_ns, 1), "present_ns_per_key": round(present_ns, 1),
            "false_positive_rate": round(fp / len(absent), 5), "batch": batch}


def numpy_in_sorted(run, keys):
    """The reference: membership by numpy's searchsorted (``keysets.in_sorted`` until the eighteenth
    session)."""
    at = np.searchsorted(run, keys)
    at[at == len(run)] = 0
    return run[at] == keys


def dirty_keys(n: int, batch: int, repeat: int, rng) -> dict:
    keys = rng.integers(0, 2**64, n, dtype=np.uint64)
    s = SortedKeySet()
    for a in range(0, n, 20_000):
        s.add(keys[a:a + 20_000])
    s.contains(keys[:10])                                  # the tail into a run; compile outside the clock
    calls = [np.sort(np.concatenate([keys[rng.integers(0, n, batch // 2)],
                                     rng.integers(0, 2**64, batch - batch // 2, dtype=np.uint64)]))
             for _ in range(50)]

    def clock(ask):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for q in calls:
                ask(q)
            best = min(best, time.perf_counter() - t0)
        return 1e9 * best / (len(calls) * batch)

    def by_numpy(q):
        out = np.zeros(len(q), np.bool_)
        for run in s._runs:
            out |= numpy_in_sorted(run, q)
        return out
    for q in calls[:5]:
        if not np.array_equal(s.contains(q), by_numpy(q)):
            raise SystemExit("dirty_keys: SortedKeySet.contains disagrees with np.searchsorted")
    ours, ref = clock(s.contains), clock(by_numpy)
    return {"bench": "dirty_keys", "keys": n, "runs": len(s._runs), "batch": batch,
            "ns_per_key": round(ours, 1), "numpy_ns_per_key": round(ref, 1), "speedup": round(ref / ours, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=25_000_000)
    ap.add_argument("--queries", type=int, default=2_000_000)
    ap.add_argument("--batch", type=int, default=25_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dirty-keys", type=int, default=22_000_000)
    ap.add_argument("--dirty-batch", type=int, default=2_000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, args.keys, dtype=np.uint64)        # added: the low half of the key space
    absent = rng.integers(2**63, 2**64, args.queries, dtype=np.uint64)   # never added: the high half
    present = keys[rng.integers(0, args.keys, args.queries)]
    machine = {"cores": os.cpu_count()}
    rows = {}
    for name, make in (("classic", ClassicChain), ("blocked", ScalableBloom)):
        rows[name] = measure(name, make, keys, absent, present, args.batch, args.repeat)
        print(json.dumps({**rows[name], **machine}), flush=True)
    c, b = rows["classic"], rows["blocked"]
    print(json.dumps({"bench": "bloom_summary", "keys": args.keys,
                      "absent_speedup": round(c["absent_ns_per_key"] / b["absent_ns_per_key"], 2),
                      "present_speedup": round(c["present_ns_per_key"] / b["present_ns_per_key"], 2),
                      "add_speedup": round(c["add_ns_per_key"] / b["add_ns_per_key"], 2),
                      "false_positive_rate_classic": c["false_positive_rate"],
                      "false_positive_rate_blocked": b["false_positive_rate"], **machine}), flush=True)
    del keys, absent, present
    print(json.dumps({**dirty_keys(args.dirty_keys, args.dirty_batch, args.repeat, rng), **machine}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
