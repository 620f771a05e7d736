"""Numba kernels of one sparse-table shard: hashing, the key index, the row arena, pull, push, admission,
expiry and eviction selection.

Every kernel takes only numpy arrays and scalars (rates and thresholds as arguments, never globals) and
releases the GIL. The table class owns the arrays and holds its lock around each call, so no kernel
races with another writer; ``pull_rows`` may run concurrently with other ``pull_rows`` calls (readers
only write the LRU tick word of rows they read, a benign word-sized store).

Data structures (see ``config.RowLayout`` for the record layout)
---------------------------------------------------------------
index : uint64[capacity], capacity a power of two
    Open addressing with linear probing. A slot is ``EMPTY`` or ``(fingerprint << 32) | row`` where
    ``fingerprint`` is the high 32 bits of ``index_hash(key)``; a probe compares fingerprints first and
    reads the row's key from the arena only on a fingerprint match. Deletion is backward-shift (no
    tombstones), so probe lengths stay short under churn.
arena_u : uint32[rows_capacity, stride] and arena_f, a float32 view of the same memory
    One record per row. Free rows form an intrusive list through word 0 and carry ``F_FREE``.
state : int64[8]
    ``S_NRAM`` live rows, ``S_NEXT`` first never-used arena row, ``S_FREE_HEAD`` head of the free list
    (-1: empty), ``S_NFREE`` length of the free list.
lay : int64[5]
    ``dim, values offset, state offset, meta offset, stride`` in words.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._jit import borrowed
from ._optimizers import HP_MAX, HP_MIN, OPT_ADAGRAD, adagrad_row, apply_other, init_state
from ._prefetch import prefetch, prefetch_last

U64 = np.uint64
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
LOW32 = np.uint64(0xFFFFFFFF)
NO_ROW = np.uint32(0xFFFFFFFF)
INDEX_SALT = np.uint64(0x5BD1E9955BD1E995)
ADMIT_SALT = np.uint64(0xA0761D6478BD642F)
SKETCH_SALT = np.uint64(0xE7037ED1A0B428DB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)

# row flags (meta word 4)
F_DIRTY = np.uint32(1)    # changed since the last clear_dirty (delta checkpoints)
F_ON_DISK = np.uint32(2)  # a copy of this row exists in RocksDB
F_SYNCED = np.uint32(4)   # ... and that copy equals the RAM row (eviction need not rewrite it)
F_FREE = np.uint32(8)     # arena row is on the free list
F_REUSED = np.uint32(16)  # a pull found it in RAM, or it was read back from RocksDB (SLRU's protected rows)
F_LISTED = np.uint32(32)  # its key is in the table's set of spilled dirty keys until the next clear (it came
                          # back dirty from RocksDB): an eviction need not add it again (``_spill_tier``)
# bits GEN_SHIFT.. of the flags word: the generation in which a push created the row (0: loaded), see
# ``sparse_tables._delta``; the flags above stay below 1 << GEN_SHIFT
GEN_SHIFT = 8
GEN_MAX = (1 << (32 - GEN_SHIFT)) - 1
FLAG_BITS = np.uint32((1 << GEN_SHIFT) - 1)

# state slots
S_NRAM = 0
S_NEXT = 1
S_FREE_HEAD = 2
S_NFREE = 3
S_GEN = 4       # the current generation (1..GEN_MAX), stamped on the rows a push creates
STATE_SLOTS = 5

def next_generation(gen: int) -> int:
    """The generation after ``gen``: 1..GEN_MAX, wrapping past 0 (which marks loaded rows)."""
    return gen + 1 if gen < GEN_MAX else 1


def generations(flags: np.ndarray) -> np.ndarray:
    """flags : uint32[m] flags words of rows -> uint32[m], each row's generation (0: loaded)."""
    return flags >> np.uint32(GEN_SHIFT)


# lay slots
L_DIM = 0
L_VAL = 1
L_STATE = 2
L_META = 3
L_STRIDE = 4

# meta word offsets from L_META
M_SHOW = 0
M_CLICK = 1
M_SEEN = 2
M_TICK = 3
M_FLAGS = 4

PREFETCH_AHEAD = 16
PIPELINE_BLOCK = 1024


# --------------------------------------------------------------------------------------- hashing
@njit(inline="always")
def fmix64(x):
    """MurmurHash3's 64-bit finalizer (Appleby): a bijection on uint64 with full avalanche."""
    x ^= x >> U64(33)
    x *= U64(0xFF51AFD7ED558CCD)
    x ^= x >> U64(33)
    x *= U64(0xC4CEB9FE1A85EC53)
    x ^= x >> U64(33)
    return x


@njit(inline="always")
def splitmix64(x):
    """SplitMix64 (Steele, Lea & Flood 2014): one step of the generator seeded with x."""
    z = x + GOLDEN
    z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


@njit(inline="always")
def index_hash(key):
    """Hash that places a key in a shard's index; salted so it is independent of vshard routing."""
    return fmix64(key ^ INDEX_SALT)


@njit(inline="always")
def uniform01(seed, key, j):
    """float64 in [0, 1) with 24 random bits: a pure function of (seed, key, j)."""
    base = splitmix64(key ^ splitmix64(seed))
    return np.float64(splitmix64(base + U64(j)) >> U64(40)) * (1.0 / 16777216.0)


# ------------------------------------------------------------------------------------ the index
@borrowed
def row_key(arena_u, r):
    return U64(arena_u[r, 0]) | (U64(arena_u[r, 1]) << U64(32))


@borrowed
def index_find(index, arena_u, key):
    """Row holding ``key``, or -1."""
    mask = U64(index.shape[0] - 1)
    h = index_hash(key)
    fp = h >> U64(32)
    i = h & mask
    while True:
        s = index[i]
        if s == EMPTY:
            return -1
        if (s >> U64(32)) == fp:
            r = np.int64(s & LOW32)
            if row_key(arena_u, r) == key:
                return r
        i = (i + U64(1)) & mask


@borrowed
def index_insert(index, key, r):
    """Insert ``key -> r``; the caller guarantees the key is absent and a free slot exists."""
    mask = U64(index.shape[0] - 1)
    h = index_hash(key)
    i = h & mask
    while index[i] != EMPTY:
        i = (i + U64(1)) & mask
    index[i] = ((h >> U64(32)) << U64(32)) | U64(r)


@borrowed
def index_remove(index, arena_u, key):
    """Remove ``key`` by backward-shift deletion (Knuth 6.4 Algorithm R). Returns False if absent."""
    mask = U64(index.shape[0] - 1)
    h = index_hash(key)
    fp = h >> U64(32)
    i = h & mask
    while True:
        s = index[i]
        if s == EMPTY:
            return False
        if (s >> U64(32)) == fp and row_key(arena_u, np.int64(s & LOW32)) == key:
            break
        i = (i + U64(1)) & mask
    j = i
    while True:
        j = (j + U64(1)) & mask
        s = index[j]
        if s == EMPTY:
            break
        home = index_hash(row_key(arena_u, np.int64(s & LOW32))) & mask
        # the entry at j may move to the hole at i unless its home lies cyclically in (i, j]
        if i <= j:
            stays = i < home <= j
        else:
            stays = home > i or home <= j
        if not stays:
            index[i] = s
            i = j
    index[i] = EMPTY
    return True


@njit(nogil=True, cache=True)
def rebuild_index(index, arena_u, lay, state):
    """Fill an all-EMPTY ``index`` with every live arena row (used to grow the index)."""
    flags_w = lay[L_META] + M_FLAGS
    for r in range(state[S_NEXT]):
        if arena_u[r, flags_w] & F_FREE:
            continue
        index_insert(index, row_key(arena_u, r), r)


@borrowed
def prefetch_homes(index, keys, start, stop, homes):
    """homes[i] = home slot of keys[start + i] for i < stop - start, prefetching each.

    Lookups run as a software pipeline over blocks of PIPELINE_BLOCK keys: first every home slot of
    the block is requested (independent loads overlap), then ``prefetch_row`` requests the row a home
    slot points to PREFETCH_AHEAD keys ahead, so the key check of ``index_find`` mostly hits cache.
    Blocks keep the prefetched index lines in L1/L2 (1024 x 64 B); measured 2-3x faster than probing
    key by key, 2x faster than one block of 100k keys when other processes share the L3, and 5-10%
    faster (push and pull, 10M rows) than blocks of 4096 keys on a host with slower memory."""
    mask = U64(index.shape[0] - 1)
    for i in range(stop - start):
        h = index_hash(keys[start + i]) & mask
        homes[i] = h
        prefetch(index, h)


@borrowed
def prefetch_row(index, arena_u, homes, i, m):
    """Prefetch both cache lines of the row that home slot homes[i + PREFETCH_AHEAD] points to."""
    if i + PREFETCH_AHEAD < m:
        s = index[homes[i + PREFETCH_AHEAD]]
        if s != EMPTY:
            r = np.int64(s & LOW32)
            prefetch(arena_u, r)
            prefetch_last(arena_u, r)  # a record straddles two cache lines


@njit(nogil=True, cache=True)
def find_rows(index, arena_u, keys, out_rows):
    """out_rows[i] = row of keys[i] or -1.  keys : uint64[n], out_rows : int64[n]."""
    n = keys.shape[0]
    homes = np.empty(min(n, PIPELINE_BLOCK), np.uint64)
    for start in range(0, n, PIPELINE_BLOCK):
        stop = min(n, start + PIPELINE_BLOCK)
        prefetch_homes(index, keys, start, stop, homes)
        for i in range(stop - start):
            prefetch_row(index, arena_u, homes, i, stop - start)
            out_rows[start + i] = index_find(index, arena_u, keys[start + i])


# ------------------------------------------------------------------------------------ the arena
@borrowed
def alloc_row(arena_u, state):
    head = state[S_FREE_HEAD]
    if head >= 0:
        nxt = arena_u[head, 0]
        state[S_FREE_HEAD] = -1 if nxt == NO_ROW else np.int64(nxt)
        state[S_NFREE] -= 1
        return head
    r = state[S_NEXT]
    if r >= arena_u.shape[0]:
        return -1
    state[S_NEXT] = r + 1
    return r


@borrowed
def free_row(arena_u, state, r, flags_w):
    head = state[S_FREE_HEAD]
    arena_u[r, 0] = NO_ROW if head < 0 else np.uint32(head)
    arena_u[r, 1] = 0
    arena_u[r, flags_w] = F_FREE
    state[S_FREE_HEAD] = r
    state[S_NFREE] += 1


@borrowed
def init_values(arena_f, r, voff, dim, key, seed, kind, scale):
    """Initial values: 0 uniform(-scale, scale), 1 normal(0, scale) by Box-Muller, 2 zeros."""
    for j in range(dim):
        if kind == 0:
            v = (2.0 * uniform01(seed, key, j) - 1.0) * scale
        elif kind == 1:
            u1 = uniform01(seed, key, 2 * j) + 1.0 / 33554432.0
            u2 = uniform01(seed, key, 2 * j + 1)
            v = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2) * scale
        else:
            v = 0.0
        arena_f[r, voff + j] = np.float32(v)


@njit(nogil=True, cache=True)
def initial_values(keys, dim, seed, kind, scale, lo, hi, out):
    """The values a pull shows for absent keys, within ``[lo, hi]`` (``min_bound``, ``max_bound``), as the row
    a push creates holds them once its update is clipped. keys : uint64[n], out : float32[n, dim]."""
    for i in range(keys.shape[0]):
        init_values(out, i, 0, dim, keys[i], U64(seed), kind, scale)
        for j in range(dim):
            out[i, j] = np.float32(min(max(out[i, j], lo), hi))


@borrowed
def new_row(index, arena_u, arena_f, state, lay, key, now_s, tick, opt, hp, seed, init_kind, init_scale):
    r = alloc_row(arena_u, state)
    if r < 0:
        return -1
    dim = lay[L_DIM]
    moff = lay[L_META]
    arena_u[r, 0] = np.uint32(key & LOW32)
    arena_u[r, 1] = np.uint32(key >> U64(32))
    init_values(arena_f, r, lay[L_VAL], dim, key, seed, init_kind, init_scale)
    init_state(arena_f, r, lay[L_STATE], dim, opt, hp)
    arena_f[r, moff + M_SHOW] = 0.0
    arena_f[r, moff + M_CLICK] = 0.0
    arena_u[r, moff + M_SEEN] = now_s
    arena_u[r, moff + M_TICK] = tick
    arena_u[r, moff + M_FLAGS] = np.uint32(state[S_GEN] << GEN_SHIFT)
    index_insert(index, key, r)
    state[S_NRAM] += 1
    return r


# ------------------------------------------------------------------------------------ admission
@njit(inline="always")
def sketch_slot(key, d, width):
    return np.int64(fmix64((key + U64(d) * GOLDEN) ^ SKETCH_SALT) % U64(width))


@borrowed
def admit(sketch, key, inc, min_count, admit_p, seed):
    """Count ``inc`` more pushes of a not-yet-admitted key in a count-min sketch (conservative update,
    Estan & Varghese 2002) and decide admission: count >= min_count, then with probability admit_p
    (a pure function of seed, key and count)."""
    depth = sketch.shape[0]
    width = sketch.shape[1]
    est = np.int64(0xFFFFFFFF)
    for d in range(depth):
        c = np.int64(sketch[d, sketch_slot(key, d, width)])
        if c < est:
            est = c
    new = min(est + inc, np.int64(0xFFFFFFFF))
    for d in range(depth):
        s = sketch_slot(key, d, width)
        if np.int64(sketch[d, s]) < new:
            sketch[d, s] = np.uint32(new)
    if new < min_count:
        return False
    if admit_p >= 1.0:
        return True
    return uniform01(seed ^ ADMIT_SALT, key, new) < admit_p


@njit(nogil=True, cache=True)
def sketch_counts(sketch, keys, out):
    """Estimated push counts of keys. keys : uint64[n], out : int64[n]."""
    for i in range(keys.shape[0]):
        est = np.int64(0xFFFFFFFF)
        for d in range(sketch.shape[0]):
            c = np.int64(sketch[d, sketch_slot(keys[i], d, sketch.shape[1])])
            if c < est:
                est = c
        out[i] = est


# ------------------------------------------------------------------------------------ batch dedup
@njit(nogil=True, cache=True)
def dedup_index(keys, grads, shows, clicks, inverse):
    """Number the distinct keys of one push in first-occurrence order and validate the payload.

    keys : uint64[n]; grads : float32[n, dim]; shows, clicks : float32[n] (or length 0 when absent);
    inverse : int64[n] gets the unique number of each key. Returns the number of unique keys, or
    ``-(i + 1)`` when ``grads[i]``, ``shows[i]`` or ``clicks[i]`` is NaN/Inf or a count is negative
    (nothing else is touched, so a rejected push leaves the table unchanged).

    Two passes: validation, then numbering. Validating inside the hash loop (an early exit per float)
    kept both from pipelining: 19 ns per key for 100k unique keys; apart, 4 + 6 ns.
    """
    n = keys.shape[0]
    dim = grads.shape[1]
    has_counts = shows.shape[0] == n and n > 0
    zero = np.float32(0.0)
    for i in range(n):
        # x * 0 is 0 for a finite x and NaN for NaN or Inf: one branch per row, a loop that vectorizes
        z = zero
        for j in range(dim):
            z += grads[i, j] * zero
        if has_counts:
            z += shows[i] * zero + clicks[i] * zero
            if shows[i] < 0 or clicks[i] < 0:
                return -(i + 1)
        if z != zero:
            return -(i + 1)
    m = 16
    while m < 2 * n:
        m *= 2
    mask = U64(m - 1)
    slots = np.full(m, -1, np.int32)  # int32: half the lines of int64 (a table of 100k keys fits L2)
    first = np.empty(n, np.int32)
    nu = 0
    for i in range(n):
        key = keys[i]
        s = index_hash(key) & mask
        while True:
            u = slots[s]
            if u < 0:
                slots[s] = nu
                first[nu] = i
                inverse[i] = nu
                nu += 1
                break
            if keys[first[u]] == key:
                inverse[i] = u
                break
            s = (s + U64(1)) & mask
    return nu


@njit(nogil=True, cache=True)
def dedup_sum(keys, grads, shows, clicks, inverse, ukeys, ugrads, ushows, uclicks, ucounts):
    """Sum grads, shows and clicks per unique key (numbered by ``dedup_index``) in occurrence order
    and count occurrences. Outputs have one row per unique key."""
    n = keys.shape[0]
    dim = grads.shape[1]
    has_counts = shows.shape[0] == n and n > 0
    seen = np.zeros(ukeys.shape[0], np.bool_)
    for i in range(n):
        u = inverse[i]
        if not seen[u]:
            seen[u] = True
            ukeys[u] = keys[i]
            for j in range(dim):
                ugrads[u, j] = grads[i, j]
            ucounts[u] = 1
            if has_counts:
                ushows[u] = shows[i]
                uclicks[u] = clicks[i]
        else:
            for j in range(dim):
                ugrads[u, j] += grads[i, j]
            ucounts[u] += 1
            if has_counts:
                ushows[u] += shows[i]
                uclicks[u] += clicks[i]


# ------------------------------------------------------------------------------------ pull / push
@njit(nogil=True, cache=True)
def _pull(index, arena_u, arena_f, lay, keys, pos, has_pos, out, tick, track_lru, miss_idx):
    """The pull pipeline, written out in one function: no helper call per key (each passes arrays, which
    LLVM does not inline across Numba's modules), the hash computed once per key, and the values copied
    8 floats at a time by a loop of constant length that LLVM vectorises. Measured with
    ``bench/table_kernel_bench.py``: the helper-based version was 2.1x slower on the same arrays.

    Keys are ``keys[pos]`` written to ``out[pos]`` with ``has_pos``, else ``keys`` to ``out``.
    """
    m = pos.shape[0] if has_pos else keys.shape[0]
    dim, voff, tick_w = lay[L_DIM], lay[L_VAL], lay[L_META] + M_TICK
    d8 = dim - dim % 8
    mask = U64(index.shape[0] - 1)
    block = min(m, PIPELINE_BLOCK)
    hashes = np.empty(block, np.uint64)
    kbuf = np.empty(block, np.uint64)
    nm = 0
    for start in range(0, m, PIPELINE_BLOCK):
        nb = min(m, start + PIPELINE_BLOCK) - start
        for b in range(nb):              # every home slot of the block requested first
            k = keys[pos[start + b]] if has_pos else keys[start + b]
            kbuf[b] = k
            h = index_hash(k)
            hashes[b] = h
            prefetch(index, h & mask)
        for b in range(nb):
            a = b + PREFETCH_AHEAD       # the row a home slot points to, PREFETCH_AHEAD keys ahead
            if a < nb:
                s = index[hashes[a] & mask]
                if s != EMPTY:
                    ra = np.int64(s & LOW32)
                    prefetch(arena_u, ra)
                    prefetch_last(arena_u, ra)
            h = hashes[b]
            key = kbuf[b]
            fp = h >> U64(32)
            i = h & mask
            r = -1
            while True:
                s = index[i]
                if s == EMPTY:
                    break
                if (s >> U64(32)) == fp:
                    rr = np.int64(s & LOW32)
                    if (U64(arena_u[rr, 0]) | (U64(arena_u[rr, 1]) << U64(32))) == key:
                        r = rr
                        break
                i = (i + U64(1)) & mask
            o = pos[start + b] if has_pos else start + b
            if r < 0:
                for j in range(dim):
                    out[o, j] = 0.0
                miss_idx[nm] = o
                nm += 1
                continue
            for j0 in range(0, d8, 8):
                for jj in range(8):
                    out[o, j0 + jj] = arena_f[r, voff + j0 + jj]
            for j in range(d8, dim):
                out[o, j] = arena_f[r, voff + j]
            if track_lru:            # flags are the word after the tick: the same cache line
                arena_u[r, tick_w] = tick
                arena_u[r, tick_w + 1] |= F_REUSED
    return nm


@njit(nogil=True, cache=True)
def pull_rows(index, arena_u, arena_f, lay, keys, out, tick, track_lru, miss_idx):
    """Gather values of keys into out; missing keys read zeros and their positions go to miss_idx.

    keys : uint64[n]; out : float32[n, dim]; miss_idx : int64[n]. Returns the number of misses.
    With ``track_lru`` the LRU tick of every row read is set to ``tick`` and the row marked ``F_REUSED``
    (a pull holds the table's lock shared: pulls only ever set that bit, every other flag changes under
    the exclusive lock).
    """
    return _pull(index, arena_u, arena_f, lay, keys, np.empty(0, np.int64), False, out, tick, track_lru,
                 miss_idx)


@njit(nogil=True, cache=True)
def pull_rows_at(index, arena_u, arena_f, lay, keys, pos, out, tick, track_lru, miss_idx):
    """``pull_rows`` of the keys ``keys[pos]`` written to ``out[pos]``: a parameter server's shard
    fills its part of a request's reply in place (no gather of its keys, no scatter of its rows).

    keys : uint64[n]; pos : int64[m] (distinct positions into keys and out); out : float32[n, dim];
    miss_idx : int64[m] gets the positions (values of pos) of missing keys. Returns the number of
    misses. Same pipeline as ``pull_rows``.
    """
    return _pull(index, arena_u, arena_f, lay, keys, pos, True, out, tick, track_lru, miss_idx)


@njit(nogil=True, cache=True, _nrt=False)
def push_rows(index, arena_u, arena_f, state, lay, ukeys, ugrads, ushows, uclicks, ucounts, has_shows,
              mode, opt, hp, now_s, tick, seed, init_kind, init_scale, sketch, min_count, admit_p,
              max_rows, out_rows, homes, found):
    """Apply one deduplicated push. Returns (rows created, keys rejected by admission, keys done).

    mode 0: optimizer update with gradient ``ugrads[i] / ushows[i]`` when ``has_shows`` (Paddle's
    CtrCommonAccessor scales by the pushed show count), else ``ugrads[i]``;
    mode 1: GEO delta, ``value += ugrads[i]`` with no optimizer, clipped to the weight bounds.
    Missing keys become rows when admitted (``sketch`` of shape (0, 0) disables admission), counting
    occurrences: ``ushows[i]`` when given (rounded; at least 1), else ``ucounts[i]``. Show grows
    by ``ushows[i]`` (or the occurrence count), click by ``uclicks[i]``; last_seen, tick and the dirty
    flag are set. out_rows : int64[u] gets each key's row or -1 when not admitted.
    Keys are unique, so each row is updated right after its lookup, while the record is still in L1.
    A new row needs a free arena row and ``rows in RAM < max_rows`` (the index's load limit); when
    either runs out at key i, the kernel returns with keys done = i, keys i.. untouched, and the caller
    grows the arena or index and calls again with the rest. So room is made only for rows really
    created, not for every key a push might create.
    homes : uint64[>= min(u, PIPELINE_BLOCK)] and found : int64[same] are scratch: the kernel runs
    without reference counting (``_nrt=False``, so the inlined optimizer rule adds no atomics) and so
    allocates nothing.
    """
    u = ukeys.shape[0]
    dim = lay[L_DIM]
    voff = lay[L_VAL]
    soff = lay[L_STATE]
    moff = lay[L_META]
    use_admission = sketch.shape[0] > 0
    counted = ucounts.shape[0] > 0      # empty: every key occurred once (a push without duplicates)
    created = 0
    rejected = 0
    mask = U64(index.shape[0] - 1)
    for i in range(u):
        b = i % PIPELINE_BLOCK
        if b == 0:
            # phase 1 of the block: every lookup (memory-bound, overlapped by prefetching), so the
            # update loop below does not crowd the out-of-order window the misses need
            # (written out as in ``_pull``: no helper call per key, one hash per key)
            m = min(u, i + PIPELINE_BLOCK) - i
            for q in range(m):
                h = index_hash(ukeys[i + q])
                homes[q] = h
                prefetch(index, h & mask)
            for q in range(m):
                a = q + PREFETCH_AHEAD
                if a < m:
                    s = index[homes[a] & mask]
                    if s != EMPTY:
                        ra = np.int64(s & LOW32)
                        prefetch(arena_u, ra)
                        prefetch_last(arena_u, ra)
                h = homes[q]
                key = ukeys[i + q]
                fp = h >> U64(32)
                j = h & mask
                r = -1
                while True:
                    s = index[j]
                    if s == EMPTY:
                        break
                    if (s >> U64(32)) == fp:
                        rr = np.int64(s & LOW32)
                        if (U64(arena_u[rr, 0]) | (U64(arena_u[rr, 1]) << U64(32))) == key:
                            r = rr
                            break
                    j = (j + U64(1)) & mask
                found[q] = r
        if b + PREFETCH_AHEAD < m and found[b + PREFETCH_AHEAD] >= 0:
            prefetch(arena_f, found[b + PREFETCH_AHEAD])
            prefetch_last(arena_f, found[b + PREFETCH_AHEAD])
        key = ukeys[i]
        r = found[b]
        if r < 0:
            if state[S_NRAM] >= max_rows or (state[S_FREE_HEAD] < 0 and state[S_NEXT] >= arena_u.shape[0]):
                return created, rejected, i
            # occurrences: the pushed show count when given (a client or worker that merged a key's
            # duplicates sends one copy with their summed show), else the copies in this push
            if has_shows and ushows[i] >= 1.0:
                count = np.int64(ushows[i] + 0.5)
            else:
                count = np.int64(ucounts[i]) if counted else np.int64(1)
            if use_admission and not admit(sketch, key, count, min_count, admit_p, seed):
                out_rows[i] = -1
                rejected += 1
                continue
            r = new_row(index, arena_u, arena_f, state, lay, key, now_s, tick, opt, hp, seed,
                        init_kind, init_scale)
            created += 1
        out_rows[i] = r
        if mode == 0:
            scale = 1.0
            if has_shows and ushows[i] > 0:
                scale = 1.0 / ushows[i]
            if opt == OPT_ADAGRAD:   # inline, no call: 86 -> 76 ns per key with dedup's split (10M rows)
                adagrad_row(arena_f, r, voff, soff, dim, ugrads, i, scale, hp)
            else:
                apply_other(arena_f, r, voff, soff, dim, ugrads, i, scale, opt, hp)
        else:               # GEO: the delta is added, then held to the bounds as an optimizer step is
            lo = hp[HP_MIN]
            hi = hp[HP_MAX]
            for j in range(dim):
                w = arena_f[r, voff + j] + ugrads[i, j]
                arena_f[r, voff + j] = lo if w < lo else (hi if w > hi else w)
        if has_shows:
            arena_f[r, moff + M_SHOW] += ushows[i]
            arena_f[r, moff + M_CLICK] += uclicks[i]
        else:
            arena_f[r, moff + M_SHOW] += np.float32(ucounts[i]) if counted else np.float32(1.0)
        arena_u[r, moff + M_SEEN] = now_s
        arena_u[r, moff + M_TICK] = tick
        arena_u[r, moff + M_FLAGS] = (arena_u[r, moff + M_FLAGS] | F_DIRTY) & ~F_SYNCED
    return created, rejected, u


# ------------------------------------------------------------------------------------ records
@njit(nogil=True, cache=True)
def upsert_records(index, arena_u, state, lay, records, add_flags, tick):
    """Write whole row records into RAM (promotion from RocksDB, load of a dump).

    records : uint32[m, stride] (key, values, state, show, click, last_seen are taken; tick and flags
    are not); add_flags : uint32[m]. An existing row is overwritten and keeps only its F_ON_DISK flag
    (its disk copy is now stale) beside ``add_flags[i]`` (its generation bits too: a loaded row's are
    0); a new row gets ``add_flags[i]``. Returns False if the arena is full.
    """
    moff = lay[L_META]
    for i in range(records.shape[0]):
        key = U64(records[i, 0]) | (U64(records[i, 1]) << U64(32))
        r = index_find(index, arena_u, key)
        if r >= 0:
            flags = (arena_u[r, moff + M_FLAGS] & F_ON_DISK) | (add_flags[i] & ~F_SYNCED)
        else:
            r = alloc_row(arena_u, state)
            if r < 0:
                return False
            arena_u[r, 0] = records[i, 0]
            arena_u[r, 1] = records[i, 1]
            index_insert(index, key, r)
            state[S_NRAM] += 1
            flags = add_flags[i]
        for w in range(2, moff + M_TICK):
            arena_u[r, w] = records[i, w]
        arena_u[r, moff + M_TICK] = tick
        arena_u[r, moff + M_FLAGS] = flags
    return True


@njit(nogil=True, cache=True)
def gather_records(arena_u, rows, out):
    """out[i] = record of rows[i]. rows : int64[m]; out : uint32[m, stride]."""
    for i in range(rows.shape[0]):
        if i + PREFETCH_AHEAD < rows.shape[0]:
            prefetch(arena_u, rows[i + PREFETCH_AHEAD])
            prefetch_last(arena_u, rows[i + PREFETCH_AHEAD])
        for w in range(arena_u.shape[1]):
            out[i, w] = arena_u[rows[i], w]


@njit(nogil=True, cache=True)
def live_rows(arena_u, state, lay, flag_mask, out_rows):
    """Rows that are live and, when flag_mask != 0, have any of those flags. Returns the count."""
    flags_w = lay[L_META] + M_FLAGS
    n = 0
    for r in range(state[S_NEXT]):
        f = arena_u[r, flags_w]
        if f & F_FREE:
            continue
        if flag_mask != 0 and (f & flag_mask) == 0:
            continue
        out_rows[n] = r
        n += 1
    return n


@njit(nogil=True, cache=True)
def clear_flag(arena_u, state, lay, flag):
    flags_w = lay[L_META] + M_FLAGS
    for r in range(state[S_NEXT]):
        arena_u[r, flags_w] &= ~flag


@njit(nogil=True, cache=True)
def remove_rows(index, arena_u, state, lay, rows):
    """Drop rows from RAM: unlink from the index and put them on the free list. The home slot of the
    row PREFETCH_AHEAD ahead is prefetched (an eviction removes rows scattered over the index)."""
    flags_w = lay[L_META] + M_FLAGS
    mask = U64(index.shape[0] - 1)
    n = rows.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch(index, index_hash(row_key(arena_u, rows[i + PREFETCH_AHEAD])) & mask)
        r = rows[i]
        index_remove(index, arena_u, row_key(arena_u, r))
        free_row(arena_u, state, r, flags_w)
        state[S_NRAM] -= 1


# ------------------------------------------------------------------------------------ eviction
@njit(nogil=True, cache=True)
def rebase_ticks(arena_u, state, lay, shift):
    """Subtract ``shift`` from every live row's tick (floor 0), keeping LRU order, before wrap-around."""
    moff = lay[L_META]
    for r in range(state[S_NEXT]):
        t = arena_u[r, moff + M_TICK]
        arena_u[r, moff + M_TICK] = t - shift if t > shift else 0


# ------------------------------------------------------------------------------------ expiry
@borrowed
def shrink_record(rec_u, rec_f, i, moff, now_s, expire_s, decay, threshold, nonclk, clk):
    """Decay show/click of one record; True if the row must be deleted (Paddle CtrCommonAccessor::Shrink)."""
    show = rec_f[i, moff + M_SHOW] * np.float32(decay)
    click = rec_f[i, moff + M_CLICK] * np.float32(decay)
    rec_f[i, moff + M_SHOW] = show
    rec_f[i, moff + M_CLICK] = click
    score = (np.float64(show) - np.float64(click)) * nonclk + np.float64(click) * clk
    if score < threshold:
        return True
    if expire_s >= 0 and now_s - np.int64(rec_u[i, moff + M_SEEN]) > expire_s:
        return True
    return False


@njit(nogil=True, cache=True)
def shrink_ram(index, arena_u, arena_f, state, lay, now_s, expire_s, decay, threshold, nonclk, clk,
               out_keys, out_on_disk, out_earlier):
    """Expiry pass over RAM rows. Deleted keys go to out_keys (uint64) with whether a disk copy
    exists (out_on_disk, bool) and whether the row was created in an earlier generation than the
    current one (out_earlier, bool); returns their count. Decay marks surviving rows dirty."""
    moff = lay[L_META]
    flags_w = moff + M_FLAGS
    n = 0
    for r in range(state[S_NEXT]):
        f = arena_u[r, flags_w]
        if f & F_FREE:
            continue
        if shrink_record(arena_u, arena_f, r, moff, now_s, expire_s, decay, threshold, nonclk, clk):
            key = row_key(arena_u, r)
            out_keys[n] = key
            out_on_disk[n] = (f & F_ON_DISK) != 0
            out_earlier[n] = np.int64(f >> np.uint32(GEN_SHIFT)) != state[S_GEN]
            n += 1
            index_remove(index, arena_u, key)
            free_row(arena_u, state, r, flags_w)
            state[S_NRAM] -= 1
        elif decay != 1.0:
            arena_u[r, flags_w] = (f | F_DIRTY) & ~F_SYNCED
    return n


@njit(nogil=True, cache=True)
def shrink_records(records, lay, now_s, expire_s, decay, threshold, nonclk, clk, out_delete):
    """Expiry pass over records read from RocksDB (in place); out_delete[i] tells which to delete."""
    rec_f = records.view(np.float32)
    moff = lay[L_META]
    for i in range(records.shape[0]):
        out_delete[i] = shrink_record(records, rec_f, i, moff, now_s, expire_s, decay, threshold,
                                      nonclk, clk)


@njit(nogil=True, cache=True)
def count_flag(arena_u, state, lay, flag):
    """Live rows carrying ``flag``."""
    flags_w = lay[L_META] + M_FLAGS
    n = 0
    for r in range(state[S_NEXT]):
        f = arena_u[r, flags_w]
        if (f & F_FREE) == 0 and (f & flag) != 0:
            n += 1
    return n
