"""Table configuration and the row layout it implies.

A row is one record of 32-bit words in a contiguous arena (see ``RowLayout``)::

    word  0..1             key (uint64, little-endian halves)
    word  2..2+dim         values (float32[dim])
    then  state_width      optimizer state (float32), see OPTIMIZER_STATE
    then  5 words          show (f32), click (f32), last_seen (u32 seconds), lru tick (u32), flags (u32)

Keeping key, values, optimizer state and metadata in one record makes every snapshot of a row consistent
with its optimizer state, and a pull touches one record.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

from .errors import TableConfigError

OPTIMIZERS = ("sgd", "adagrad", "std_adagrad", "adam", "ftrl")
OPTIMIZER_CODE = {name: i for i, name in enumerate(OPTIMIZERS)}
INITIALIZERS = ("uniform", "normal", "zeros")
INITIALIZER_CODE = {name: i for i, name in enumerate(INITIALIZERS)}
EVICTIONS = ("slru", "lru")
SPILL_COMPACTIONS = ("level", "universal")

#: the widest count-min sketch a table may have: each of its ``sketch_depth`` rows is ``sketch_width`` uint32
#: (4 GiB here), allocated when the table starts; 2^64 passed and every server died with a numpy traceback
MAX_SKETCH_WIDTH = 1 << 30

#: Row layout format version, recorded with every row dump.
LAYOUT_VERSION = 1
META_WORDS = 5
KEY_WORDS = 2


def optimizer_state_width(optimizer: str, dim: int) -> int:
    """Number of float32 optimizer-state words per row.

    sgd: 0; adagrad (row-wise): 1 accumulator; std_adagrad: dim accumulators; adam: m[dim], v[dim],
    beta1^t, beta2^t; ftrl: z[dim], n[dim].
    """
    return {"sgd": 0, "adagrad": 1, "std_adagrad": dim, "adam": 2 * dim + 2, "ftrl": 2 * dim}[optimizer]


#: a field's annotation -> (its kind, whether None is allowed); ``TableConfig.__post_init__`` checks each
#: value's type, so a YAML ``seed: [1, 2]`` or ``dim: true`` is refused naming the field instead of
#: failing inside a server (``np.uint64([1, 2] % 2**64)``) or passing as 1
_FIELD_KINDS = {"int": ("int", False), "float": ("float", False), "str": ("str", False),
                "str | None": ("str", True), "float | None": ("float", True)}
_KIND_NAMES = {"int": "an int", "float": "a number", "str": "a string"}


def _is_kind(value, kind: str) -> bool:
    """An int is any integral number but a bool (numpy's too), a float any real number but a bool."""
    if kind == "str":
        return isinstance(value, str)
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral if kind == "int" else numbers.Real)


@dataclass(frozen=True)
class TableConfig:
    """Configuration of one sparse-table shard.

    Parameters
    ----------
    dim : int
        Embedding width (float32 values per row).
    optimizer : str
        One of ``sgd``, ``adagrad`` (row-wise accumulator, TorchRec/FBGEMM ``ROWWISE_ADAGRAD``),
        ``std_adagrad`` (per-dimension accumulator), ``adam`` (lazy Adam: per-row beta powers),
        ``ftrl`` (McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches", Algorithm 1).
    learning_rate : float
        Step size (FTRL's alpha).
    initializer : str
        ``uniform`` in [-init_range, init_range], ``normal`` with std init_range, or ``zeros``.
        Initial values are a pure function of (seed, key).
    init_range : float
    seed : int
    memory_rows : int
        With ``spill_path`` set, at most this many rows stay in RAM after each call (high watermark);
        an eviction pass writes rows (chosen by ``eviction``) to RocksDB until
        ``spill_low_watermark * memory_rows`` rows remain. Ignored without ``spill_path``.
    memory_bytes : int
        With ``spill_path`` set, the RAM of this table on one server in bytes (0: off, ``memory_rows``
        bounds the RAM tier instead). One budget for the server's local shards of the table together:
        rows, index, RocksDB's block cache and memtables, the spill filters and dirty-key sets, the
        admission sketch; the RAM tier holds what the rest leaves and gives up rows as the growing
        parts grow (see ``sparse_tables.budget``). Replaces ``memory_rows`` when set.
    spill_path : str or None
        RocksDB directory for cold rows; None keeps every row in RAM. The directory is claimed, never
        taken: it must be new, empty, or one this engine left (see ``sparse_tables.spill``).
    max_rows : int
        RAM-only tables (no ``spill_path``): at most this many rows; 0 means no limit. Past it a new
        key is refused as a key that admission does not admit (a pull reads it without creating a row,
        a push of it is dropped) and counted in ``stats()["rows_refused_full"]``; rows of keys already
        present still update. Must be 0 with ``spill_path`` (``memory_rows`` bounds RAM there, the disk
        the rest). A parameter server's ``SparseHost`` reads it per server and divides it among its
        local shards.
    initial_accumulator, epsilon : float
        Adagrad accumulator start value and denominator epsilon (also Adam's epsilon). For ``adam``
        epsilon is Kingma & Ba's "epsilon hat", added to the uncorrected ``sqrt(v)`` (Paddle's
        SparseAdamSGDRule, PyTorch's SparseAdam), NOT the epsilon of a dense table's Adam (PyTorch's
        Adam, added to the bias-corrected ``sqrt(v / (1 - beta2^t))``): the same value damps more here,
        by ``1 / sqrt(1 - beta2^t)`` with the row's own step count ``t`` (31.6x at t = 1 with beta2 =
        0.999); formulas in ``sparse_tables._optimizers``.
    beta1, beta2 : float
        Adam moment decay rates.
    ftrl_beta, ftrl_l1, ftrl_l2 : float
        FTRL-Proximal beta, L1 and L2 strengths.
    min_bound, max_bound : float
        Values are clipped to this range after every optimizer update, and the initial values a pull shows
        for absent keys too (Paddle's weight_bounds, which its SGD rules apply to initial values).
    min_count : int
        Admission: a key becomes a row once it has been pushed this many times (occurrences); counts of
        not-yet-admitted keys live in a count-min sketch (``sketch_depth`` x ``sketch_width`` uint32;
        ``sketch_width`` at most ``MAX_SKETCH_WIDTH``).
    admit_probability : float
        Admission: once ``min_count`` is reached, each push admits the key with this probability
        (a pure function of seed, key and count).
    expire_after : float or None, seconds of the table clock
        ``shrink`` deletes rows not pushed for longer than this.
    delete_threshold : float
        ``shrink`` deletes rows whose decayed show/click score falls below this; the score is Paddle's
        CtrCommonAccessor ``(show - click) * nonclk_coeff + click * click_coeff``.
    show_click_decay : float
        Factor applied to show and click at every ``shrink`` (Paddle's show_click_decay_rate).
    spill_low_watermark : float
        Fraction of the RAM tier's cap (``memory_rows``, or what ``memory_bytes`` leaves) an eviction
        pass brings RAM down to, writing at most 65536 rows more than it takes to get under the cap
        (``_spill_tier.EVICT_PASS_ROWS``), so one pass never holds requests for long.
    num_threads : int
        Threads a large pull is split across (the kernels release the GIL).
    eviction : str
        Which RAM rows an eviction pass writes to RocksDB. ``slru`` (segmented LRU; Karedla, Love and
        Wherry 1994, the protected/probationary split of memcached's and Caffeine's caches): a row is
        *reused* once a pull finds it in RAM, or once it is read back from RocksDB; rows never reused
        go first, oldest first, while they are more than a quarter of the RAM tier (in expectation,
        under sampling), then the least recently used of all. A key seen once (30% of the keys of
        ``bench/scale_bench.py``'s traffic) so leaves RAM before a key that comes back, and a reused
        row that stops coming back still ages out. ``lru``: the least recently used rows, reused or not.
        A push does not mark a row reused: training pushes the keys it has just pulled.
    spill_compaction : str
        RocksDB's compaction of the spill store. ``level`` (leveled, dynamic level sizes: 1.12x the
        live rows on disk at most while growing to 100M keys, 1.13x with a base save's spool beside
        them; the catch-up after a base restore, 1.39x while every shard merged at once, now runs one
        shard at a time, ``_catch_up``: 1.02x);
        ``universal`` (tiered sorted runs: up to 1.5x the live rows on disk between merges, and a full merge
        keeps its inputs until it ends: 1.63x-1.9x measured while growing to 100M keys): in
        ``bench/spill_ingest_bench.py`` at 100M rows it kept up with the writes at 19% less CPU per row where
        leveled fell 11 GB behind, and in ``bench/scale_bench.py`` at 100M keys it pulled 25-54% more keys/s
        than leveled at the end (docs/scale-measurements.md). ``engine plan`` sizes disk by the peak measured
        for the style; where disk binds (10^12 keys) leveled needs fewer servers, hence the default. Ignored
        without ``spill_path``.

    Raises
    ------
    TableConfigError
        A value of the wrong type (an int field takes integral numbers but not bools, a float field real
        numbers but not bools, a ``str`` field strings) or out of its range, naming ``TableConfig.FIELD``.
    """

    dim: int = 8
    optimizer: str = "adagrad"
    learning_rate: float = 0.05
    initializer: str = "uniform"
    init_range: float = 1e-4
    seed: int = 0
    memory_rows: int = 1_000_000
    memory_bytes: int = 0
    spill_path: str | None = None
    max_rows: int = 0
    initial_accumulator: float = 0.0
    epsilon: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0
    min_bound: float = -math.inf
    max_bound: float = math.inf
    min_count: int = 1
    admit_probability: float = 1.0
    sketch_width: int = 1 << 20
    sketch_depth: int = 4
    expire_after: float | None = None
    delete_threshold: float = 0.0
    show_click_decay: float = 1.0
    nonclk_coeff: float = 0.1
    click_coeff: float = 1.0
    spill_low_watermark: float = 0.9
    num_threads: int = 2
    eviction: str = "slru"
    spill_compaction: str = "level"

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> TableConfigError:
            return TableConfigError(f"TableConfig.{name} must be {expected}, got {getattr(self, name)!r}")

        for f in fields(self):          # types first: the range checks below assume them
            kind, optional = _FIELD_KINDS[f.type]
            value = getattr(self, f.name)
            if not (value is None and optional) and not _is_kind(value, kind):
                raise bad(f.name, _KIND_NAMES[kind] + (" or None" if optional else ""))
        if not isinstance(self.dim, int) or self.dim <= 0:
            raise bad("dim", "a positive int")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", f"one of {OPTIMIZERS}")
        if self.initializer not in INITIALIZERS:
            raise bad("initializer", f"one of {INITIALIZERS}")
        for name in ("learning_rate", "epsilon", "ftrl_beta"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise bad(name, "a finite number > 0")
        for name in ("init_range", "initial_accumulator", "ftrl_l1", "ftrl_l2", "delete_threshold",
                     "nonclk_coeff", "click_coeff"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise bad(name, "a finite number >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, "in [0, 1)")
        if not self.min_bound < self.max_bound:
            raise bad("min_bound", f"< max_bound ({self.max_bound})")
        if not isinstance(self.memory_rows, int) or self.memory_rows < 1:
            raise bad("memory_rows", "an int >= 1")
        if not isinstance(self.max_rows, int) or isinstance(self.max_rows, bool) or self.max_rows < 0:
            raise bad("max_rows", "an int >= 0 (0: no limit)")
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes < 0:
            raise bad("memory_bytes", "an int >= 0 (bytes; 0: off)")
        if self.memory_bytes and not self.spill_path:
            raise bad("memory_bytes", "0 without spill_path (a budget needs RocksDB for the rows it does not "
                      "keep in RAM; RAM-only tables are bounded by max_rows)")
        if self.max_rows and self.spill_path:
            raise bad("max_rows", f"0 when spill_path is set (memory_rows={self.memory_rows} bounds RAM and "
                      f"RocksDB at {self.spill_path!r} holds the rest; the disk is the bound)")
        if not isinstance(self.min_count, int) or self.min_count < 0:
            raise bad("min_count", "an int >= 0")
        if not 0 < self.admit_probability <= 1:
            raise bad("admit_probability", "in (0, 1]")
        if not isinstance(self.sketch_width, int) or not 64 <= self.sketch_width <= MAX_SKETCH_WIDTH:
            raise bad("sketch_width", f"an int in [64, {MAX_SKETCH_WIDTH}] (2^30: 4 GiB per sketch row)")
        if not isinstance(self.sketch_depth, int) or not 1 <= self.sketch_depth <= 16:
            raise bad("sketch_depth", "an int in [1, 16]")
        if self.expire_after is not None and not self.expire_after >= 0:
            raise bad("expire_after", "None or a number of seconds >= 0")
        if not 0 < self.show_click_decay <= 1:
            raise bad("show_click_decay", "in (0, 1]")
        if not 0 < self.spill_low_watermark < 1:
            raise bad("spill_low_watermark", "in (0, 1)")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise bad("num_threads", "an int >= 1")
        if self.eviction not in EVICTIONS:
            raise bad("eviction", f"one of {list(EVICTIONS)}")
        if self.spill_compaction not in SPILL_COMPACTIONS:
            raise bad("spill_compaction", f"one of {list(SPILL_COMPACTIONS)}")

    @property
    def uses_admission(self) -> bool:
        return self.min_count > 1 or self.admit_probability < 1.0

    @classmethod
    def from_dict(cls, data: dict, path: str = "table") -> "TableConfig":
        """Build from a mapping, rejecting unknown keys with the key path named."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TableConfigError(f"{path}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class RowLayout:
    """Word offsets of one row record (see the module docstring)."""

    dim: int
    state_width: int

    @property
    def values(self) -> int:
        return KEY_WORDS

    @property
    def state(self) -> int:
        return KEY_WORDS + self.dim

    @property
    def meta(self) -> int:
        return KEY_WORDS + self.dim + self.state_width

    @property
    def stride(self) -> int:
        return self.meta + META_WORDS

    @property
    def row_bytes(self) -> int:
        return 4 * self.stride

    @classmethod
    def of(cls, config: TableConfig) -> "RowLayout":
        return cls(config.dim, optimizer_state_width(config.optimizer, config.dim))
