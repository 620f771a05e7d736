"""Each table kernel against the slow reference in tests/naive.py (also run with NUMBA_DISABLE_JIT=1)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_tables import TableConfig, optimizer_state_width
from sparse_tables import _kernels as K
from sparse_tables._optimizers import HP_SIZE, apply_updates, init_states
from sparse_tables.config import OPTIMIZER_CODE, OPTIMIZERS
from sparse_tables.keysets import KeySet, ScalableBloom, SortedKeySet, in_sorted, unique_keys
from tests import naive

pytestmark = pytest.mark.nojit


def hp_of(cfg: TableConfig) -> np.ndarray:
    hp = np.zeros(HP_SIZE)
    hp[:] = [cfg.learning_rate, cfg.epsilon, cfg.initial_accumulator, cfg.beta1, cfg.beta2,
             cfg.ftrl_beta, cfg.ftrl_l1, cfg.ftrl_l2, cfg.min_bound, cfg.max_bound]
    return hp


@pytest.mark.parametrize("initializer", ["uniform", "normal", "zeros"])
def test_initial_values_are_a_pure_function_of_seed_and_key(initializer):
    cfg = TableConfig(dim=5, initializer=initializer, init_range=0.3, seed=11)
    keys = np.array([0, 1, 2**63 + 5, 2**64 - 1, 123456789], np.uint64)
    out = np.empty((len(keys), 5), np.float32)
    K.initial_values(keys, 5, np.uint64(11), {"uniform": 0, "normal": 1, "zeros": 2}[initializer], 0.3,
                     -np.inf, np.inf, out)
    expected = np.stack([naive.initial_values(cfg, int(k)) for k in keys])
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    if initializer == "uniform":
        assert np.all(np.abs(out) <= 0.3) and len(np.unique(out)) == out.size


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_rules_match_reference(optimizer):
    dim = 3
    cfg = TableConfig(dim=dim, optimizer=optimizer, learning_rate=0.1, initial_accumulator=0.5,
                      ftrl_l1=0.01, ftrl_l2=0.1, min_bound=-0.4, max_bound=0.4)
    sw = optimizer_state_width(optimizer, dim)
    rng = np.random.default_rng(3)
    rows = np.zeros((4, dim + sw), np.float32)
    rows[:, :dim] = rng.uniform(-0.1, 0.1, (4, dim))
    hp = hp_of(cfg)
    init_states(rows, dim, OPTIMIZER_CODE[optimizer], hp)
    ref = [(rows[i, :dim].copy(), naive.initial_state(cfg)) for i in range(4)]
    np.testing.assert_array_equal(rows[:, dim:], np.stack([s for _, s in ref]) if sw else rows[:, dim:])
    for step in range(6):
        grads = rng.standard_normal((4, dim)).astype(np.float32)
        scales = np.array([1.0, 0.5, 0.25, 1.0 / 3])
        apply_updates(rows, grads, scales, dim, OPTIMIZER_CODE[optimizer], hp)
        ref = [naive.optimizer_step(cfg, w, s, grads[i], scales[i]) for i, (w, s) in enumerate(ref)]
        np.testing.assert_allclose(rows[:, :dim], np.stack([w for w, _ in ref]), atol=1e-6, rtol=1e-5)
        if sw:
            np.testing.assert_allclose(rows[:, dim:], np.stack([s for _, s in ref]), atol=1e-6, rtol=1e-5)
    assert np.all(rows[:, :dim] >= -0.4) and np.all(rows[:, :dim] <= 0.4)


def _arena(n, stride=9):
    arena = np.zeros((n, stride), np.uint32)
    state = np.zeros(4, np.int64)
    state[K.S_FREE_HEAD] = -1
    return arena, state


def test_index_insert_find_remove_against_dict():
    rng = np.random.default_rng(5)
    lay = np.array([2, 2, 4, 4, 9], np.int64)
    arena, state = _arena(64)
    index = np.full(64, K.EMPTY, np.uint64)  # small: long probe chains, wrap-around
    ref: dict[int, int] = {}
    universe = rng.integers(0, 2**64, 80, dtype=np.uint64)
    for _ in range(400):
        key = universe[rng.integers(0, len(universe))]
        k = int(key)
        if k in ref and rng.random() < 0.5:
            r = ref.pop(k)
            K.remove_rows(index, arena, state, lay, np.array([r], np.int64))
        elif k not in ref and len(ref) < 48:
            r = K.alloc_row(arena, state)
            arena[r, 0] = np.uint32(k & 0xFFFFFFFF)
            arena[r, 1] = np.uint32(k >> 32)
            arena[r, 4 + K.M_FLAGS] = 0
            K.index_insert(index, key, r)
            state[K.S_NRAM] += 1
            ref[k] = r
        rows = np.empty(len(universe), np.int64)
        K.find_rows(index, arena, universe, rows)
        assert [int(r) for r in rows] == [ref.get(int(u), -1) for u in universe]
    assert state[K.S_NRAM] == len(ref)
    assert state[K.S_NEXT] - state[K.S_NFREE] == len(ref)


def test_dedup_sums_duplicates_in_first_occurrence_order():
    keys = np.array([5, 3, 5, 9, 3, 5], np.uint64)
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    shows = np.array([1, 2, 3, 4, 5, 6], np.float32)
    clicks = np.array([0, 1, 0, 1, 1, 0], np.float32)
    inverse = np.empty(6, np.int64)
    nu = K.dedup_index(keys, grads, shows, clicks, inverse)
    assert nu == 3 and inverse.tolist() == [0, 1, 0, 2, 1, 0]
    uk, ug = np.empty(3, np.uint64), np.empty((3, 2), np.float32)
    us, uc, cnt = np.empty(3, np.float32), np.empty(3, np.float32), np.empty(3, np.int64)
    K.dedup_sum(keys, grads, shows, clicks, inverse, uk, ug, us, uc, cnt)
    assert uk.tolist() == [5, 3, 9]
    np.testing.assert_array_equal(ug, [grads[[0, 2, 5]].sum(0), grads[[1, 4]].sum(0), grads[3]])
    assert us.tolist() == [10, 7, 4] and uc.tolist() == [0, 2, 1] and cnt.tolist() == [3, 2, 1]
    grads[4, 1] = np.nan
    assert K.dedup_index(keys, grads, shows, clicks, inverse) == -5
    grads[4, 1] = 0
    shows[2] = -1
    assert K.dedup_index(keys, grads, shows, clicks, inverse) == -3
    no_counts = np.empty(0, np.float32)
    assert K.dedup_index(np.array([1, 2], np.uint64), grads[:2], no_counts, no_counts, inverse) == 2


def test_admission_sketch_counts_and_probability():
    sketch = np.zeros((4, 1024), np.uint32)
    key = np.uint64(42)
    assert not K.admit(sketch, key, 1, 3, 1.0, np.uint64(0))
    assert not K.admit(sketch, key, 1, 3, 1.0, np.uint64(0))
    assert K.admit(sketch, key, 1, 3, 1.0, np.uint64(0))
    out = np.empty(1, np.int64)
    K.sketch_counts(sketch, np.array([42], np.uint64), out)
    assert out[0] == 3
    # probability admission is a pure function of (seed, key, count), as in the reference
    for k in range(50):
        s = np.zeros((2, 256), np.uint32)
        got = K.admit(s, np.uint64(k), 1, 1, 0.3, np.uint64(9))
        assert got == (naive.uniform01(9 ^ naive.ADMIT_SALT, k, 1) < 0.3)


def test_admission_sketch_update_is_conservative():
    """A narrow sketch (many collisions): each count raises only the cells below the key's new estimate
    to it (Estan & Varghese's conservative update), never adds to every cell; estimates never fall
    below a key's true count. (A plain count-min update passed the test above: no collisions there.)"""
    depth, width = 4, 64
    sketch = np.zeros((depth, width), np.uint32)
    ref = np.zeros((depth, width), np.int64)
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64, 40, dtype=np.uint64)
    true = {}
    for _ in range(400):
        key = keys[rng.integers(len(keys))]
        inc = int(rng.integers(1, 4))
        K.admit(sketch, key, inc, 10**9, 1.0, np.uint64(0))
        slots = [K.sketch_slot(key, d, width) for d in range(depth)]
        new = min(ref[d, s] for d, s in enumerate(slots)) + inc
        for d, s in enumerate(slots):
            ref[d, s] = max(ref[d, s], new)
        true[int(key)] = true.get(int(key), 0) + inc
    np.testing.assert_array_equal(sketch, ref)
    out = np.empty(len(true), np.int64)
    K.sketch_counts(sketch, np.array(list(true), np.uint64), out)
    assert np.all(out >= np.array(list(true.values()))) and np.any(out > np.array(list(true.values())))


def test_keyset_and_bloom_have_no_false_negatives():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**64, 3000, dtype=np.uint64)
    ks = KeySet(4)
    ks.add(keys[:1500])
    ks.add(keys[:10])
    assert len(ks) == 1500
    assert ks.contains(keys[:1500]).all() and not ks.contains(keys[1500:]).any()
    assert sorted(ks.to_array().tolist()) == sorted(keys[:1500].tolist())
    bloom = ScalableBloom(initial_capacity=256)
    bloom.add(keys[:1500])
    assert bloom.may_contain(keys[:1500]).all()
    assert bloom.may_contain(keys[1500:]).mean() < 0.1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=8), st.integers(1, 7), st.integers(0, 2**32))
def test_blocked_bloom_chain_keeps_every_key_through_growth(batches, nhash, seed):
    """Keys added in batches of any size, across the chain's growth (initial capacity 64: a batch
    may span several new filters), are all still found; each filter starts on a 64-byte boundary."""
    rng = np.random.default_rng(seed)
    bloom = ScalableBloom(initial_capacity=64, nhash=nhash)
    added = []
    for n in batches:
        keys = rng.integers(0, 2**64, n, dtype=np.uint64)
        bloom.add(keys)
        added.append(keys)
        allk = np.concatenate(added)
        assert bloom.may_contain(allk).all()
        assert bloom.may_contain(allk[::-1][::2]).all()           # a strided view
    assert all((bloom._pool.ctypes.data + 8 * int(s)) % 64 == 0 for s in bloom._starts)
    assert bloom.nbytes == bloom._pool.nbytes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=70),
       st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=70), st.integers(0, 3))
def test_in_sorted_is_membership(members, others, repeat):
    """The lockstep binary searches answer exactly np.isin, for runs with repeated keys, the extreme
    keys 0 and 2**64 - 1, queries in any order and in groups that do not fill the lockstep's 32; ``out``
    is OR-ed into, not overwritten."""
    run = np.sort(np.array(members + members[:repeat] + [0, 2**64 - 1][:repeat], np.uint64))
    queries = np.array(others + members[::2] + [0, 1, 2**64 - 2, 2**64 - 1], np.uint64)
    assert np.array_equal(in_sorted(run, queries), np.isin(queries, run))
    out = np.zeros(len(queries), np.bool_)
    out[::3] = True
    assert np.array_equal(in_sorted(run, queries, out), np.isin(queries, run) | (np.arange(len(queries)) % 3 == 0))
    sk = SortedKeySet()
    sk.add(run)
    sk.add(queries[:5])
    assert np.array_equal(sk.contains(queries), np.isin(queries, np.concatenate([run, queries[:5]])))


def test_blocked_bloom_false_positive_rate_and_arguments():
    """10 bits and 6 bits set per key: ~1% false positives for one full filter (0.96% measured at 16M
    keys), about the sum over a chain of full filters; an empty filter answers no; nhash beyond the
    hash's 7 slices of 9 bits is refused."""
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**63, 40_000, dtype=np.uint64)
    absent = rng.integers(2**63, 2**64, 40_000, dtype=np.uint64)
    assert not ScalableBloom().may_contain(absent).any()
    one = ScalableBloom(initial_capacity=40_000)
    one.add(keys)
    assert len(one._starts) == 1 and 0.003 < one.may_contain(absent).mean() < 0.02
    chain = ScalableBloom(initial_capacity=5_000)          # 5k + 10k + 20k full, 5k of 40k
    chain.add(keys)
    assert len(chain._starts) == 4 and 0.01 < chain.may_contain(absent).mean() < 0.06
    chain.clear()
    assert chain.nbytes == 0 and not chain.may_contain(keys).any()
    with pytest.raises(ValueError, match="nhash"):
        ScalableBloom(nhash=8)


def _key_order_reference(keys: np.ndarray) -> int:
    from sparse_tables import _load_kernels as L
    if len(np.unique(keys)) != len(keys):
        return L.DUPLICATES
    return L.SORTED_UNIQUE if all(int(a) < int(b) for a, b in zip(keys[:-1], keys[1:])) else L.UNIQUE


def test_key_order_agrees_with_np_unique_on_random_batches():
    from sparse_tables._load_kernels import DUPLICATES, SORTED_UNIQUE, UNIQUE, key_order
    rng = np.random.default_rng(5)
    seen = set()
    for n in (0, 1, 2, 3, 17, 500, 3000):
        for trial in range(6):
            keys = rng.integers(0, 2**64, n, dtype=np.uint64)
            if trial in (1, 4) and n > 1:                     # a repeat somewhere (adjacent after sorting)
                keys[rng.integers(n)] = keys[rng.integers(n)]
            if trial == 2 and n:
                keys[:min(n, 2)] = [0, 2**64 - 1][:min(n, 2)]   # the extremes of the key space
            if trial >= 3:
                keys = np.sort(keys)
            if trial == 5 and n > 1:
                keys[1] = keys[0]                              # sorted, not strictly: a duplicate
            got = key_order(keys)
            assert got == _key_order_reference(keys), (n, trial)
            seen.add(got)
    assert seen == {SORTED_UNIQUE, UNIQUE, DUPLICATES}
    # colliding probes: many keys that share their low bits still hash apart and are told apart
    keys = (np.arange(4000, dtype=np.uint64) << np.uint64(40)) | np.uint64(7)
    assert key_order(keys[::-1].copy()) == UNIQUE
    assert key_order(np.concatenate([keys, keys[-1:]])) == DUPLICATES


def test_fill_records_matches_the_column_copies():
    import pyarrow as pa
    from sparse_tables.config import RowLayout
    from sparse_tables.rows import batch_to_records, records_to_batch, row_schema
    for optimizer, dim in (("adagrad", 3), ("sgd", 4), ("adam", 2)):
        layout = RowLayout(dim, optimizer_state_width(optimizer, dim))
        rng = np.random.default_rng(8)
        m = 50
        rec = rng.integers(0, 2**32, (m, layout.stride), dtype=np.uint64).astype(np.uint32)
        rec[:, layout.meta + K.M_TICK] = 0
        rec[:, layout.meta + K.M_FLAGS] = 0
        batch = records_to_batch(rec, layout, row_schema(layout, optimizer))
        for part in (batch, batch.slice(7, 30)):             # a slice: its columns start at an offset
            expected = rec[7:37] if part is not batch else rec
            got = batch_to_records(part, layout)
            assert got.dtype == np.uint32 and got.shape == expected.shape
            np.testing.assert_array_equal(got, expected)
            keys = part.column(0).to_numpy()
            np.testing.assert_array_equal(got[:, :2].copy().view(np.uint64).ravel(), keys)
        assert isinstance(batch, pa.RecordBatch)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 64) - 1), max_size=300), st.integers(0, 4))
def test_unique_keys_is_np_unique(values, repeats):
    keys = np.array(values * (1 + repeats) if values else [], dtype=np.uint64)
    got = unique_keys(keys)
    assert got.dtype == np.uint64 and np.array_equal(got, np.unique(keys))


def test_unique_keys_refuses_other_dtypes_instead_of_wrapping_them():
    with pytest.raises(TypeError, match="uint64 array, got int64"):
        unique_keys(np.array([-1, 2], np.int64))
