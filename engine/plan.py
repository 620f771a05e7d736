"""``engine plan``: the servers, RAM, disk, network and checkpoint time a deployment needs.

Every figure of a plan is one of: a measurement read from a JSON-lines file of benchmark results (the
bench scripts' own output, one object per line with a ``bench`` field), a config value, a command-line
flag (or its stated default), an assumption the plan names as one, or a number computed from those by a
formula below. ``Plan.inputs`` lists each with its source.

Sizes are in bytes, rates in keys/s or bytes/s, times in seconds. For ``K`` keys (rows of one sparse
table), ``E`` examples/s over all workers, batch ``B`` examples per worker step, ``U`` unique keys per
worker batch, embedding ``dim`` and ``w = optimizer_state_width(optimizer, dim)``:

RAM (``bytes_per_row`` of ``bench/table_bench.py``, measured at its own dim and optimizer)::

    b_ram   = overhead + 4 * (dim + w)       overhead = bytes_per_row.bytes_per_row (key, metadata, index
                                             and arena slack: the RSS beyond the floats)
    RAM     = (rows_in_ram * b_ram + rows_on_disk * bloom_bits / 8) * rss_factor
              bloom_bits: the spill tier's Bloom filter per key (sparse_tables.keysets); rss_factor =
              scale_summary.rss_max_over_budget (a server's largest RSS over its memory budget, measured),
              else 1 and RocksDB's block cache and memtables are not counted
              memory_rows: a server holds <= cap + (server_ram / rss_factor - cap * b_ram) / (bloom_bits / 8)
              keys, cap = memory_rows * local_shards rows in RAM (none if cap * b_ram * rss_factor > its RAM)
    RAM     = memory_bytes * rss_factor     with tables.sparse.T.memory_bytes: the table's RAM on a server,
              everything included; its RAM tier holds ``sparse_tables.budget.MemoryBudget.rows_cap`` rows
              per local shard once the filters of the server's keys are counted, so a server can hold at
              most (budget's free bytes - local_shards * (headroom + slack + 1024) rows) / (bloom_bits / 8)
              keys before its filters leave no RAM tier

Disk (rows live in exactly one tier, so only spilled rows are on disk). Every ``scale_summary`` figure
(here and ``rss_factor`` above) comes from the latest row measured with the table's ``spill_compaction``
(rows without the field were leveled), or, when there is none, from the latest row of any style, with a
note::

    b_spill = scale_summary.disk_bytes_per_spilled_row
            | disk_bytes_per_row * keys_held / (keys_held - ram_rows_at_full)   (older rows: bytes per key
                                             counted the RAM tier's keys too)
    peak    = max(1, scale_summary.disk_peak_over_live)   the spill directory's largest bytes per live row,
                                             sampled through the whole bench (a compaction holding its inputs
                                             and outputs at once; a base save's spool of the RAM tier) of the
                                             table's style only | DISK_PEAK_ASSUMED[style] (RocksDB's own
                                             figures, an assumption)
    b_disk  = b_spill * (8 + row_bytes) / (8 + scale_summary.record_bytes) * peak
            | (8 + row_bytes) * space_amplification     (assumption when nothing is measured, leveled's peak
                                             included; x DISK_PEAK_ASSUMED[style] / DISK_PEAK_ASSUMED["level"])
    disk    = rows_on_disk * b_disk

Rows in RAM: ``--ram-fraction f`` keeps ``f * K`` rows in RAM; without the flag a config with ``spill_path``
keeps its budget per server (``memory_bytes`` as above, else ``memory_rows * cluster.local_shards`` rows),
and a config without ``spill_path`` plans ``f = 0.1`` (an assumption, stated).

Throughput (``ps_bench.py``'s 1-server ``pull`` / ``push`` through gRPC, on ``c_bench`` cores)::

    pull_load = push_load = E / B * U                     keys/s over all servers
    capacity  = keys_per_s * server_cores / c_bench * s   keys/s per server (linear in cores: assumed)
    s         = spill.keys_per_s / spill.in_memory_keys_per_s  when rows spill, else 1
    cpu       = pull_load / pull_capacity + push_load / push_capacity   servers' worth of cores

Network per worker step (the wire protocol: uint64 keys, float32 rows and gradients, float32 show and
click per pushed key; protobuf framing ignored; dense ``P`` floats each way every ``m`` steps,
``m = model.dense_merge_steps`` in async mode, 1 in sync, no dense traffic to the servers in GEO or
hybrid, whose workers all-reduce the tower among themselves: a note gives its bytes)::

    to servers   = U * (8 + 8 + 4 * dim + 8) + 4 * P / m
    from servers = U * 4 * dim + 4 * P / m
    per second   = E / B * per step; the sparse part spreads over the servers by vshard, the dense part
                   sits on the servers owning its blocks of engine.ps.codec.DENSE_BLOCK floats

Servers per resource: keys route by vshard, ``num_vshards = V`` in contiguous ranges, so the busiest of
``N`` servers holds ``ceil(V / N) / V`` of every key-proportional demand; ``servers_for`` finds the least
``N`` at which that share fits one server. The plan needs the most servers any resource needs.

Checkpoint (``ckpt_bench.py``'s local-disk ``ckpt_base_save`` / ``ckpt_base_restore``)::

    ckpt bytes = K * ckpt.bytes_per_row * (row_bytes - 8) / ckpt.raw_bytes_per_row
                 + N * local_shards * sketch_depth * sketch_width * 4     (with admission: each shard's sketch)
    save time  = (busiest share * rows' bytes + one server's sketches) / (save mb_per_s * 1e6 / bench servers)
                 (restore alike)

The sketches are counted at their in-memory size, an upper bound: zstd writes a sketch whose counters are
mostly small in about an eighth of it (2.0 MB for 16 MiB at 69% of its counters set).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .plan_inputs import BenchResults, Figure, PlanInputError, Where
from .plan_workload import MEASURE_BATCHES, measure_unique_keys  # noqa: F401 - part of this module's API

__all__ = ["BenchResults", "Figure", "PlanInputError", "make_plan", "measure_unique_keys", "servers_for",
           "busiest_share", "this_machine"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BENCH_RESULTS = REPO / "bench" / "results" / "this_machine.jsonl"
DEFAULT_NETWORK_GBPS = 10.0
DEFAULT_RAM_FRACTION = 0.1
DEFAULT_SPACE_AMPLIFICATION = 1.2
CTR_KINDS = ("ctr_dnn", "deepfm", "ctr_online")


def this_machine(path: str | Path = ".") -> dict[str, Figure]:
    """Defaults for a server: this machine's RAM and cores, the free disk at ``path``, and an assumed
    network. Keys ``ram``, ``disk`` (bytes), ``cores``, ``network`` (bytes/s per direction)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "ram": Figure("server_ram", float(ram), "bytes", "default", "this machine: os.sysconf physical pages"),
        "disk": Figure("server_disk", float(shutil.disk_usage(path).free), "bytes", "default",
                       f"this machine: free disk at {Path(path).resolve()}"),
        "cores": Figure("server_cores", float(len(os.sched_getaffinity(0))), "cores", "default",
                        "this machine: os.sched_getaffinity"),
        "network": Figure("server_network", DEFAULT_NETWORK_GBPS * 1e9 / 8, "bytes/s", "assumption",
                          f"assumed {DEFAULT_NETWORK_GBPS:g} Gb/s full duplex (--network-gbps)"),
    }


def shares(n: int, num_vshards: int) -> list[tuple[int, float]]:
    """``[(servers, share)]``: how ``num_vshards`` vshards in contiguous ranges split over ``n`` servers
    (``r = V mod n`` servers hold ``ceil(V / n) / V`` of the keys, the others ``floor(V / n) / V``). With
    ``n > V`` (a plan that needs more vshards) the keys are taken as split evenly, ``1 / n`` each."""
    if n > num_vshards:
        return [(n, 1.0 / n)]
    q, r = divmod(num_vshards, n)
    return [(c, s) for c, s in ((r, (q + 1) / num_vshards), (n - r, q / num_vshards)) if c]


def busiest_share(n: int, num_vshards: int) -> float:
    """Share of the keys on the busiest of ``n`` servers: ``ceil(V / n) / V`` (``1 / n`` if ``n > V``)."""
    return shares(n, num_vshards)[0][1]


def servers_for(demand: float, capacity: float, num_vshards: int) -> int:
    """Least ``n >= 1`` with ``busiest_share(n, V) * demand <= capacity``.

    ``demand`` and ``capacity`` in one unit (bytes, keys/s, ...). With ``q = floor(V * capacity /
    demand)`` the busiest server may hold ``q`` vshards, so ``n = ceil(V / q)``; when even ``n = V``
    does not fit (``q = 0``), ``ceil(demand / capacity)`` (an even split over more vshards than ``V``).

    Raises
    ------
    ValueError
        ``capacity <= 0`` or ``demand < 0``.

    Examples
    --------
    >>> servers_for(3.0, 1.0, 1024)     # 3 servers hold 342 vshards each at most: 342/1024*3 > 1
    4
    """
    if capacity <= 0 or demand < 0:
        raise ValueError(f"expected capacity > 0 and demand >= 0, got {capacity}, {demand}")
    if demand <= capacity:
        return 1
    q = math.floor(num_vshards * capacity / demand * (1 + 1e-12))
    return math.ceil(demand / capacity) if q == 0 else math.ceil(num_vshards / q)


def _dense_floats(cfg) -> int | None:
    """Dense parameters ``P`` of a CTR model (``models.build_model(...).dense_size``), else None."""
    kind = cfg.model.kind
    if kind not in CTR_KINDS:
        return None
    from models import build_model
    p = cfg.model.params
    net = p.network if kind == "ctr_online" else kind
    return build_model(net, num_slots=max(1, len(p.slots)), dim=p.dim, dense_dim=p.dense_dim,
                       hidden=p.hidden, seed=p.seed).dense_size


# ------------------------------------------------------------------------------------ the plan
@dataclass
class Resource:
    """Servers one resource needs. ``demand`` and ``capacity`` (per server) share ``unit``; ``servers``
    is None when no number of servers meets it (``note`` says why)."""

    name: str
    demand: float
    capacity: float
    unit: str
    servers: int | None
    note: str = ""
    use: float | None = None          # busiest server's load / capacity at the plan's server count


@dataclass
class Plan:
    """A deployment: inputs with sources, servers per resource, the binding one(s), the result."""

    inputs: list[Figure]
    resources: list[Resource]
    servers: int
    binding: list[str]
    feasible: bool
    deployment: dict
    notes: list[str] = field(default_factory=list)
    header: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-ready dict (``engine plan --json`` prints it)."""
        return {**self.header, "servers": self.servers, "binding": self.binding, "feasible": self.feasible,
                "resources": [dataclasses.asdict(r) for r in self.resources], "deployment": self.deployment,
                "inputs": [dataclasses.asdict(f) for f in self.inputs], "notes": self.notes}


class _Record:
    """The inputs and notes of a plan as it is computed: every number passes through ``use``."""

    def __init__(self):
        self.inputs: list[Figure] = []
        self.notes: list[str] = []

    def use(self, fig: Figure) -> float:
        """Record ``fig`` (once: the same figure, source included, is not listed twice)."""
        if fig not in self.inputs:
            self.inputs.append(fig)
        return fig.value

    def conf(self, key: str, value: float, unit: str) -> float:
        return self.use(Figure(key.rsplit(".", 1)[-1], float(value), unit, "config", key))

    def computed(self, name: str, value: float, unit: str, formula: str) -> float:
        return self.use(Figure(name, float(value), unit, "computed", formula))


@dataclass
class _Rows:
    """Bytes of one row of the planned table, and how its RAM is counted."""

    record: int            # RowLayout.row_bytes: the arena record
    ram: float             # b_ram
    disk: float            # b_disk
    rss_factor: float      # scale_summary.rss_max_over_budget, or 1
    bloom_bytes: float     # RAM per spilled key: the spill tier's Bloom filter

    def ram_of(self, rows_in_ram: float, rows: float) -> float:
        """RAM bytes of ``rows`` rows of which ``rows_in_ram`` are in RAM."""
        return (rows_in_ram * self.ram + (rows - rows_in_ram) * self.bloom_bytes) * self.rss_factor


def make_plan(cfg, bench: BenchResults, *, keys: float, examples_per_s: float,
              unique_keys_per_batch: float | None = None, table: str | None = None,
              server_ram_bytes: float | None = None, server_disk_bytes: float | None = None,
              server_cores: float | None = None, network_gbps: float | None = None,
              ram_fraction: float | None = None, workers: int | None = None,
              space_amplification: float = DEFAULT_SPACE_AMPLIFICATION, config_path: str = "",
              measure_batches: int = MEASURE_BATCHES) -> Plan:
    """Plan a deployment of ``cfg`` holding ``keys`` rows at ``examples_per_s`` (see the module docstring
    for every formula).

    Parameters
    ----------
    cfg : engine.config.EngineConfig
        With a ``model`` section; its sparse table ``table`` (default ``model.sparse_table``, or the only
        sparse table) holds the keys.
    bench : BenchResults
    keys : float, rows > 0
    examples_per_s : float, examples/s over all workers > 0 (word2vec: raw words/s)
    unique_keys_per_batch : float, optional
        Keys per worker batch after dedup; default measured from the data (``measure_unique_keys``).
    server_ram_bytes, server_disk_bytes : float, bytes, optional
    server_cores : float, optional
    network_gbps : float, Gb/s per direction, optional
        One server's machine; defaults from ``this_machine()``.
    ram_fraction : float in (0, 1], optional
        Share of the keys kept in RAM (see the module docstring for the default).
    workers : int, optional
        Worker processes; adds each worker's network per second.
    space_amplification : float >= 1
        On-disk bytes per record byte, used only when no ``scale_summary.disk_bytes_per_row`` is measured.

    Returns
    -------
    Plan
        ``servers`` is the most any resource needs; ``feasible`` is False when no number of servers
        meets some resource (its ``Resource.servers`` is None and its note says why).

    Raises
    ------
    PlanInputError
        A bad argument, a missing or malformed bench figure, or unmeasurable unique keys.
    ConfigError
        The config has no model or no such sparse table.
    """
    _check(keys >= 1, "--keys must be >= 1 (a count of rows)", keys)
    _check(examples_per_s > 0, "--examples-per-s must be > 0", examples_per_s)
    _check(ram_fraction is None or 0 < ram_fraction <= 1, "--ram-fraction must be in (0, 1]", ram_fraction)
    _check(workers is None or workers >= 1, "--workers must be >= 1", workers)
    _check(space_amplification >= 1, "--space-amplification must be >= 1", space_amplification)
    if cfg.model is None:
        raise ConfigError("model: missing; engine plan sizes the tables of a model (set model.kind)")
    p = cfg.model.params
    name, t = _table_of(cfg, table)
    rec = _Record()
    K = rec.use(Figure("keys", float(keys), "rows", "flag", "--keys"))
    E = rec.use(Figure("examples_per_s", float(examples_per_s), "examples/s", "flag", "--examples-per-s"))
    batch_key = "batch_size" if hasattr(p, "batch_size") else "batch_words"
    B = rec.conf(f"model.{batch_key}", getattr(p, batch_key), "examples")
    V = int(rec.conf("cluster.num_vshards", cfg.cluster.num_vshards, "vshards"))
    slots = len(p.slots) if hasattr(p, "slots") else None
    if unique_keys_per_batch is None:
        U = rec.use(measure_unique_keys(cfg, measure_batches))
    else:
        _check(unique_keys_per_batch > 0, "--unique-keys-per-batch must be > 0", unique_keys_per_batch)
        _check(slots is None or unique_keys_per_batch <= B * slots,
               f"--unique-keys-per-batch cannot exceed batch_size x slots = {B:g} x {slots} (one key per "
               f"example and slot)", unique_keys_per_batch)
        U = rec.use(Figure("unique_keys_per_batch", float(unique_keys_per_batch), "keys", "flag",
                           "--unique-keys-per-batch"))
    m = this_machine()
    given = {"ram": (server_ram_bytes, "--server-ram-gb"), "disk": (server_disk_bytes, "--server-disk-gb"),
             "cores": (server_cores, "--server-cores"),
             "network": (None if network_gbps is None else network_gbps * 1e9 / 8, "--network-gbps")}
    mach = {}
    per_flag = {"ram": 1e9, "disk": 1e9, "cores": 1, "network": 1e9 / 8}     # the flag's unit -> ours
    for k, (v, flag) in given.items():       # an error shows the value as given (GB, Gb/s), not in bytes
        _check(v is None or v > 0, f"{flag} must be > 0", v if v is None else v / per_flag[k])
        fig = m[k] if v is None else dataclasses.replace(m[k], value=float(v), kind="flag", source=flag)
        mach[k] = rec.use(fig)

    rows = _row_bytes(rec, bench, t, f"tables.sparse.{name}", space_amplification)
    steps = rec.computed("steps_per_s", E / B, "steps/s", f"examples_per_s / {batch_key}")
    load = rec.computed("pull_push_keys_per_s", steps * U, "keys/s", "steps_per_s x unique_keys_per_batch")
    if cfg.mode == "geo":
        rec.notes.append("mode geo: pulls and pushes happen every geo.k_steps steps for the rows touched since; "
                         "the per-step figures are an upper bound")

    mem = _memory(rec, cfg, t, name, K, V, rows, mach, ram_fraction)
    res = list(mem.resources)
    n_mem = max([r.servers for r in res if r.servers] or [1])
    k_mem = busiest_share(n_mem, V) * K
    res += _throughput(rec, bench, load, V, mach["cores"], spills=mem.ram_rows(k_mem) < k_mem)
    net = _network(rec, cfg, t.dim, U, steps, V, mach["network"])
    res.append(net.resource)

    feasible = all(r.servers is not None for r in res)
    N = max([r.servers for r in res if r.servers is not None] or [1])
    binding = [r.name for r in res if r.servers == N]
    share = busiest_share(N, V)
    if N > V:
        rec.notes.append(f"{N} servers need cluster.num_vshards >= {N} (config: {V}; fixed when the tables are "
                         f"created): figures assume an even split")
    per = share * K
    in_ram = mem.ram_rows(per)
    total_in_ram = sum(c * mem.ram_rows(sh * K) for c, sh in shares(N, V))
    dep = {"servers": N, "keys_per_server": per, "ram_share": in_ram / per, "rows_in_ram_per_server": in_ram,
           "ram_per_server_bytes": mem.ram_bytes(per),
           "ram_total_bytes": sum(c * mem.ram_bytes(sh * K) for c, sh in shares(N, V)),
           "disk_per_server_bytes": (per - in_ram) * rows.disk, "disk_total_bytes": (K - total_in_ram) * rows.disk,
           "network_per_step_per_worker_bytes": {"to_servers": net.to_servers, "from_servers": net.from_servers},
           "network_per_server_bytes_per_s": net.busiest(N),
           "pull_keys_per_s_per_server": share * load, "push_keys_per_s_per_server": share * load}
    at_n = {"ram": per if mem.resources[0].unit == "keys" else dep["ram_per_server_bytes"],
            "disk": dep["disk_per_server_bytes"], "network": dep["network_per_server_bytes_per_s"]}
    for r in res:
        r.use = at_n.get(r.name, share * r.demand) / r.capacity
    if workers is not None:
        W = rec.use(Figure("workers", workers, "workers", "flag", "--workers"))
        dep["network_per_worker_bytes_per_s"] = {"to_servers": steps / W * net.to_servers,
                                                 "from_servers": steps / W * net.from_servers}
        dep["examples_per_s_per_worker"] = E / W
    held = bench.figure("scale_summary", "keys_held", unit="rows", required=False, where=_scale_rows(bench, t))
    if held is not None and per > held.value:
        rec.use(held)
        rec.notes.append(f"{per:.3g} keys per server is {per / held.value:.3g}x the most one table held in "
                         f"bench/scale_bench.py ({held.value:.3g}): extrapolated")
    sketch = 0
    if t.uses_admission:
        sketch = rec.computed("ckpt_sketch_bytes_per_server", cfg.cluster.local_shards * t.sketch_depth
                              * t.sketch_width * 4, "bytes", f"cluster.local_shards x tables.sparse.{name}."
                              "sketch_depth x sketch_width x 4 (admission's count-min sketch, saved per shard)")
    dep["checkpoint"] = _checkpoint(rec, bench, K, share, rows.record, N, sketch)
    header = {"config": config_path, "model": cfg.model.kind, "mode": cfg.mode, "table": name, "dim": t.dim,
              "optimizer": t.optimizer, "example": "raw words" if batch_key == "batch_words" else "examples",
              "bench_results": bench.path}
    return Plan(rec.inputs, res, N, binding, feasible, dep, rec.notes, header)


def _table_of(cfg, table: str | None):
    """``(name, TableConfig)`` of the table ``--keys`` counts."""
    p = cfg.model.params
    name = table or getattr(p, "sparse_table", None) or (next(iter(cfg.sparse_tables))
                                                          if len(cfg.sparse_tables) == 1 else None)
    if name is None or name not in cfg.sparse_tables:
        raise ConfigError(f"tables.sparse: {'no table ' + repr(name) if name else 'several tables'} "
                          f"({sorted(cfg.sparse_tables)}); name the one --keys counts with --table")
    return name, cfg.sparse_tables[name]


def _row_bytes(rec: _Record, bench: BenchResults, t, tk: str, space_amplification: float) -> _Rows:
    """RAM and disk bytes per row of table ``t`` (``tk`` its key path): see the module docstring."""
    from sparse_tables import RowLayout, optimizer_state_width

    dim = int(rec.conf(f"{tk}.dim", t.dim, "floats"))
    w = optimizer_state_width(t.optimizer, t.dim)
    rec.use(Figure("optimizer_state_width", w, "floats", "code",
                   f"sparse_tables.optimizer_state_width({t.optimizer!r}, {t.dim}) ({tk}.optimizer)"))
    record = RowLayout(t.dim, w).row_bytes
    overhead = rec.use(bench.figure("bytes_per_row", "bytes_per_row", unit="bytes", name="ram_overhead_per_row",
                                    need="RAM per row beyond its floats"))
    b_ram = rec.computed("ram_bytes_per_row", overhead + 4 * (dim + w), "bytes",
                         f"ram_overhead_per_row + 4 * (dim {dim} + state {w})")
    import inspect

    from sparse_tables.keysets import ScalableBloom
    bits = inspect.signature(ScalableBloom).parameters["bits_per_key"].default
    bloom = rec.use(Figure("bloom_bits_per_spilled_key", bits, "bits", "code",
                           "sparse_tables.keysets.ScalableBloom bits_per_key")) / 8
    style = t.spill_compaction
    where = _scale_rows(bench, t)
    if where is None and bench.latest("scale_summary") is not None:
        rec.notes.append(f"no scale_summary row was measured with {tk}.spill_compaction {style!r}: the latest "
                         f"row of another compaction is used for RSS and bytes per row")
    rss = bench.figure("scale_summary", "rss_max_over_budget", unit="x", required=False, where=where)
    if rss is not None:
        rec.use(rss)
        if not getattr(t, "memory_bytes", 0):
            rec.notes.append("rss_max_over_budget was measured against a memory_bytes budget (RocksDB "
                             "included) and is applied here to rows + filters: an approximation")
    elif not getattr(t, "memory_bytes", 0):
        rec.notes.append("RAM counts rows and the spill tier's Bloom filter only: RocksDB's block cache and "
                         "memtables are not measured (run bench/scale_bench.py for rss_max_over_budget)")
    b_disk, measured = _disk_bytes(rec, bench, record, space_amplification, where)
    if measured:
        b_disk = rec.computed("disk_bytes_per_row_at_peak", b_disk * _disk_peak(rec, bench, style, tk), "bytes",
                              "bytes per spilled row x disk_peak_factor")
    elif style != "level":  # the assumed space amplification stands for leveled compaction, its peak included
        f = rec.computed("disk_peak_factor", DISK_PEAK_ASSUMED[style] / DISK_PEAK_ASSUMED["level"], "x",
                         f"DISK_PEAK_ASSUMED: {style}'s assumed peak over leveled's ({tk}.spill_compaction)")
        b_disk = rec.computed("disk_bytes_per_row_at_peak", b_disk * f, "bytes",
                              "disk_bytes_per_row x disk_peak_factor")
    rss_factor = rss.value if rss else 1.0
    if rss_factor < 1.0:     # RSS below its budget: the RAM tier never filled in that run; plan on the budget
        rec.notes.append(f"rss_max_over_budget {rss_factor:g} < 1 is taken as 1 (a server may use all its budget)")
        rss_factor = 1.0
    return _Rows(record, b_ram, b_disk, rss_factor, bloom)


def _style_rows(style: str) -> Where:
    """The ``scale_summary`` rows measured with compaction ``style`` (rows without the field were
    leveled: scale_bench had no --compaction then)."""
    return Where("compaction", style, "level")


def _scale_rows(bench: BenchResults, t) -> Where | None:
    """The ``scale_summary`` rows of table ``t``'s ``spill_compaction``, or None (any row) when none was
    measured so."""
    where = _style_rows(t.spill_compaction)
    return where if bench.latest("scale_summary", where) is not None else None


#: RocksDB's own figures for the extra disk its compaction holds, used when scale_bench measured none for
#: the table's compaction style: leveled with dynamic level sizes keeps ~1/(1 - 1/10) of the live data
#: (a size ratio of 10 between levels); universal's full merge writes a copy of every input before it
#: deletes them, up to twice the data (RocksDB wiki, "Leveled Compaction" and "Universal Compaction")
DISK_PEAK_ASSUMED = {"level": 1.111, "universal": 2.0}
#: the optimizers ``sparse_tables.optimizer_state_width`` knows (a bench row naming another is refused)
OPTIMIZERS = ("sgd", "adagrad", "std_adagrad", "adam", "ftrl")


def _disk_bytes(rec: _Record, bench: BenchResults, record: int, space_amplification: float,
                where: Where | None) -> tuple[float, bool]:
    """Disk bytes per spilled row between compactions, and whether they were measured (else assumed from
    ``space_amplification``, compaction's peak included): see the module docstring."""
    from sparse_tables import RowLayout, optimizer_state_width

    on_disk = 8 + record                                   # RocksDB key + the row's arena record
    per_spilled = bench.figure("scale_summary", "disk_bytes_per_spilled_row", unit="bytes", required=False,
                               where=where)
    disk = per_spilled or bench.figure("scale_summary", "disk_bytes_per_row", unit="bytes", required=False,
                                       where=where)
    if disk is None:
        amp = rec.use(Figure("space_amplification", space_amplification, "x", "assumption",
                             "--space-amplification (no scale_summary.disk_bytes_per_row measured)"))
        return rec.computed("disk_bytes_per_row", on_disk * amp, "bytes",
                            f"(8 key + {record} record) x space_amplification: an ASSUMPTION, not a measurement"
                            ), False
    b_disk = rec.use(disk)
    srow = bench.latest("scale_summary", where)[1]
    if per_spilled is None:
        # disk_bytes_per_row divides RocksDB's bytes by all keys, the RAM tier's too; only spilled rows
        # are on disk, so the bytes per spilled row are larger by keys / (keys - rows in RAM)
        held = bench.figure("scale_summary", "keys_held", unit="rows", required=False, where=where)
        in_ram = bench.figure("scale_summary", "ram_rows_at_full", unit="rows", required=False, where=where,
                              positive=False)
        if held is not None and in_ram is not None and 0 <= in_ram.value < held.value:
            k, r = rec.use(held), rec.use(in_ram)
            b_disk = rec.computed("disk_bytes_per_spilled_row", b_disk * k / (k - r), "bytes",
                                  "disk_bytes_per_row x keys_held / (keys_held - ram_rows_at_full)")
        else:
            rec.notes.append("scale_summary gives neither disk_bytes_per_spilled_row nor ram_rows_at_full: its "
                             "disk_bytes_per_row (over all keys, the RAM tier's included) is used per spilled row")
    if "record_bytes" in srow or "dim" in srow:
        if "record_bytes" in srow:
            bench_rec = 8 + rec.use(bench.figure("scale_summary", "record_bytes", unit="bytes", where=where))
        else:
            sdim = rec.use(bench.figure("scale_summary", "dim", unit="floats", where=where))
            opt = srow.get("optimizer", "adagrad")
            n = bench.latest("scale_summary", where)[0]
            if sdim != int(sdim) or not isinstance(opt, str) or opt not in OPTIMIZERS:
                bad = f"dim must be a whole number, got {sdim:g}" if sdim != int(sdim) else \
                    f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {opt!r}"
                raise PlanInputError(f"{bench.path}:{n}: scale_summary.{bad}")
            sdim = int(sdim)
            bench_rec = 8 + RowLayout(sdim, optimizer_state_width(opt, sdim)).row_bytes
        return rec.computed("disk_bytes_per_row_scaled", b_disk * on_disk / bench_rec, "bytes",
                            f"bytes per spilled row x {on_disk} / {bench_rec:g} (8 key + record bytes, "
                            f"config / bench)"), True
    rec.notes.append("scale_summary records neither record_bytes nor dim: its bytes per row are used as "
                     "measured, not rescaled to this table's row")
    return b_disk, True


def _disk_peak(rec: _Record, bench: BenchResults, style: str, tk: str) -> float:
    """The factor on a spilled row's disk bytes at compaction's peak (>= 1): ``disk_peak_over_live`` of
    the latest scale_summary measured with the table's compaction style, else ``DISK_PEAK_ASSUMED``."""
    fig = bench.figure("scale_summary", "disk_peak_over_live", unit="x", required=False,
                       name="disk_peak_over_live", where=_style_rows(style))
    if fig is None:
        fig = Figure("disk_peak_over_live", DISK_PEAK_ASSUMED[style], "x", "assumption",
                     f"RocksDB's documented space amplification of {style} compaction ({tk}.spill_compaction; "
                     f"no scale_summary row with compaction {style!r} measured it)")
    peak = rec.use(fig)
    return rec.computed("disk_peak_factor", max(1.0, peak), "x",
                        "max(1, disk_peak_over_live): disk is sized for compaction's peak, never below the "
                        "end of the growth")


@dataclass
class _Memory:
    """RAM and disk of a server by the keys it holds: ``ram_rows(k)`` rows of ``k`` in RAM,
    ``ram_bytes(k)`` bytes of RAM; ``resources``: the ``ram`` and ``disk`` Resources."""

    ram_rows: object
    ram_bytes: object
    resources: list


def _memory(rec: _Record, cfg, t, name: str, K: float, V: int, rows: _Rows, mach: dict,
            ram_fraction: float | None) -> _Memory:
    """RAM and disk by the rows kept in RAM (see the module docstring)."""
    tk = f"tables.sparse.{name}"
    shards = cfg.cluster.local_shards
    disk_rows = mach["disk"] / rows.disk                   # spilled rows one server's disk holds
    if ram_fraction is None and t.spill_path and getattr(t, "memory_bytes", 0):
        return _memory_budget(rec, t, tk, shards, K, V, rows, mach)
    if ram_fraction is None and t.spill_path:
        cap = rec.computed("ram_rows_per_server", t.memory_rows * shards, "rows",
                           f"{tk}.memory_rows x cluster.local_shards {shards} (spill_path set)")
        # a full RAM tier plus the filters of every key beyond it: RAM, not only disk, bounds a server's keys
        srv_ram = rows.ram_of(cap, cap)
        if srv_ram <= mach["ram"]:
            most = rec.computed("max_keys_per_server", cap + (mach["ram"] / rows.rss_factor - cap * rows.ram)
                                / rows.bloom_bytes, "rows", "ram_rows_per_server + (server_ram / rss_factor - "
                                "ram_rows_per_server x ram_bytes_per_row) / Bloom bytes per key")
            ram = Resource("ram", K, most, "keys", servers_for(K, most, V),
                           "keys whose filters fit the server's RAM beside memory_rows x local_shards rows")
        else:
            ram = Resource("ram", srv_ram, mach["ram"], "bytes", None, "memory_rows x local_shards rows alone "
                           "are over the server's RAM: lower memory_rows or pass --ram-fraction")
        disk = Resource("disk", K * rows.disk, mach["disk"], "bytes", servers_for(K, disk_rows + cap, V),
                        f"each server also keeps {cap:.3g} rows in RAM")
        return _Memory(lambda k: min(k, cap), lambda k: rows.ram_of(min(k, cap), k), [ram, disk])
    if ram_fraction is not None:
        f = rec.use(Figure("ram_fraction", ram_fraction, "share", "flag", "--ram-fraction"))
    else:
        f = rec.use(Figure("ram_fraction", DEFAULT_RAM_FRACTION, "share", "assumption",
                           f"assumed ({tk}.spill_path is null: as written every row stays in RAM; "
                           f"--ram-fraction 1 plans that)"))
    ram, disk = rows.ram_of(f * K, K), (1 - f) * K * rows.disk
    return _Memory(lambda k: f * k, lambda k: rows.ram_of(f * k, k), [
        Resource("ram", ram, mach["ram"], "bytes", servers_for(ram, mach["ram"], V)),
        Resource("disk", disk, mach["disk"], "bytes", servers_for(disk, mach["disk"], V) if disk else 1)])


def _memory_budget(rec: _Record, t, tk: str, shards: int, K: float, V: int, rows: _Rows, mach: dict) -> _Memory:
    """``memory_bytes``: the table's RAM on a server, split by ``sparse_tables.budget.MemoryBudget``."""
    from sparse_tables.budget import HEADROOM_ROWS, SLACK_ROWS, MemoryBudget

    budget_bytes = int(rec.conf(f"{tk}.memory_bytes", t.memory_bytes, "bytes"))
    try:
        sketch = t.sketch_depth * t.sketch_width * 4 if t.uses_admission else 0    # as engine.ps.hosts
        budget = MemoryBudget(budget_bytes, shards, rows.record, sketch)
    except ValueError as e:
        raise ConfigError(f"{tk}.memory_bytes: {e}") from None
    token = budget.register()
    free = budget_bytes - budget.rocksdb_bytes - budget.index_bytes - budget.sketch_bytes - budget.reserve_bytes
    if free <= shards * (HEADROOM_ROWS + SLACK_ROWS + 1024) * rows.record:     # was servers_for's ValueError
        raise ConfigError(f"{tk}.memory_bytes: {budget_bytes} leaves no room for a RAM tier of {shards} shard(s) "
                          f"and spill filters after RocksDB, the index and the reserve; raise it")
    most = rec.computed("max_keys_per_server", (free - shards * (HEADROOM_ROWS + SLACK_ROWS + 1024) * rows.record)
                        / rows.bloom_bytes, "rows", "(MemoryBudget's free bytes - local_shards x (headroom + "
                        "slack + 1024) records) / Bloom bytes per key: the filters leave no RAM tier past it")

    def ram_rows(k: float) -> float:
        budget.report(token, int(k * rows.bloom_bytes), 0)    # the filters of a server holding k keys
        return min(k, shards * budget.rows_cap())

    srv_ram = budget_bytes * rows.rss_factor
    over = srv_ram > mach["ram"]
    rec.notes.append("with memory_bytes, dirty spilled keys (8 bytes each until the next delta checkpoint) "
                     "also take the RAM tier's room; not modeled")
    return _Memory(ram_rows, lambda k: srv_ram, [
        Resource("ram", K, most, "keys", None if over else servers_for(K, most, V),
                 f"over the server's RAM: memory_bytes x rss_factor = {srv_ram:.3g} bytes" if over else
                 "keys whose spill filters fit memory_bytes beside a RAM tier"),
        Resource("disk", K * rows.disk, mach["disk"], "bytes", servers_for(K * rows.disk, mach["disk"], V),
                 "rows in RAM not subtracted (a small share)")])


def _throughput(rec: _Record, bench: BenchResults, load: float, V: int, cores: float, *, spills: bool):
    """Resources ``pull``, ``push`` and ``pull+push`` for ``load`` keys/s of each."""
    pull = rec.use(bench.figure("ps_pull", "keys_per_s", unit="keys/s", name="ps_pull_keys_per_s",
                                need="pull rate of one server through gRPC"))
    push = rec.use(bench.figure("ps_push", "keys_per_s", unit="keys/s", name="ps_push_keys_per_s",
                                need="push rate of one server through gRPC"))
    mrow = bench.latest("machine")
    if "cpus_granted" in bench.latest("ps_pull")[1]:
        c_bench = rec.use(bench.figure("ps_pull", "cpus_granted", unit="cores", name="ps_bench_cores"))
    elif mrow is not None and "sched_getaffinity_cpus" in mrow[1]:
        c_bench = rec.use(bench.figure("machine", "sched_getaffinity_cpus", unit="cores", name="ps_bench_cores"))
    else:
        c_bench = rec.use(Figure("ps_bench_cores", len(os.sched_getaffinity(0)), "cores", "assumption",
                                 "ps_bench rows record no cores: taken as this machine's (os.sched_getaffinity)"))
    rec.notes.append("server rates scale linearly with cores from ps_bench's 1 server sharing its cores with "
                     "its 2 clients (an assumption; conservative on the server's side)")
    for src, key in (("table_pull", "keys_per_s_1_thread"), ("table_push", "keys_per_s")):
        fig = bench.figure(src, key, unit="keys/s", name=f"{src}_per_core_in_process", required=False)
        if fig is not None:                  # context: what the table alone allows, without RPC
            rec.use(dataclasses.replace(fig, source=fig.source + " (context: not used in the sizing)"))
    s = 1.0
    if spills:
        sp = rec.use(bench.figure("spill", "keys_per_s", unit="keys/s", name="spill_keys_per_s",
                                  need="push rate with most rows on disk"))
        sp_mem = rec.use(bench.figure("spill", "in_memory_keys_per_s", unit="keys/s",
                                      name="spill_in_memory_keys_per_s",
                                      need="the same pushes with every row in RAM"))
        s = rec.computed("spill_factor", min(1.0, sp / sp_mem), "x", "spill.keys_per_s / "
                         "spill.in_memory_keys_per_s, at most 1 (measured on pushes; applied to pulls too: an "
                         "assumption)")
    pull_cap = rec.computed("pull_capacity_per_server", pull * cores / c_bench * s, "keys/s",
                            "ps_pull_keys_per_s x server_cores / ps_bench_cores x spill_factor")
    push_cap = rec.computed("push_capacity_per_server", push * cores / c_bench * s, "keys/s",
                            "ps_push_keys_per_s x server_cores / ps_bench_cores x spill_factor")
    cpu = load / pull_cap + load / push_cap
    return [Resource("pull", load, pull_cap, "keys/s", servers_for(load, pull_cap, V)),
            Resource("push", load, push_cap, "keys/s", servers_for(load, push_cap, V)),
            Resource("pull+push", cpu, 1.0, "servers' cores", servers_for(cpu, 1.0, V),
                     "pulls and pushes share a server's cores")]


@dataclass
class _Network:
    to_servers: float          # bytes per worker step
    from_servers: float
    busiest: object            # n -> bytes/s of the busiest server's busier direction
    resource: Resource


def _network(rec: _Record, cfg, dim: int, U: float, steps: float, V: int, nic: float) -> _Network:
    """Network per worker step and per server second (see the module docstring)."""
    from .ps.codec import DENSE_BLOCK

    kind = cfg.model.kind
    P = _dense_floats(cfg)
    if P is None:
        dense_step, P = 0.0, 0
        rec.notes.append(f"dense traffic is not modeled for model.kind {kind!r}")
    else:
        rec.use(Figure("dense_floats", P, "floats", "computed", f"models.build_model({kind!r}, ...).dense_size"))
        merge = cfg.model.params.dense_merge_steps if cfg.mode == "async" else 1
        dense_step = 0.0 if cfg.mode in ("geo", "hybrid") else 4 * P / merge
        if cfg.mode == "hybrid":
            W = cfg.cluster.workers
            ring = 2 * (W - 1) / W * 4 * P          # a ring all-reduce's bytes sent (and received) per rank
            rec.notes.append(f"mode hybrid: the dense tower ({P} floats) does not travel to the servers while "
                             f"training (rank 0 uploads it at checkpoints); the workers all-reduce it over MPI "
                             f"every step, {ring / 1e6:.3g} MB each way per worker step at cluster.workers={W} "
                             f"(ring: 2 (W - 1) / W x 4 P bytes), on the workers' network")
    shows = 8 if kind in CTR_KINDS else 0
    to_srv = U * (8 + 8 + 4 * dim + shows) + dense_step
    from_srv = U * 4 * dim + dense_step
    sparse = max(steps * (to_srv - dense_step), steps * (from_srv - dense_step))   # the busier direction
    dense = steps * dense_step
    blocks = max(1, math.ceil(P / DENSE_BLOCK)) if P else 1

    def busiest(n: int) -> float:
        dense_share = min(1.0, math.ceil(blocks / n) * DENSE_BLOCK / P) if P else 0.0
        return busiest_share(n, V) * sparse + dense_share * dense

    floor = (min(1.0, DENSE_BLOCK / P) if P else 0.0) * dense       # once every block has its own server
    if floor > nic:
        n, note = None, (f"the dense table's traffic alone ({floor * 8 / 1e9:.3g} Gb/s on the server of its "
                         f"largest block) exceeds the network: more servers do not help; raise model.batch_size"
                         f"{' or model.dense_merge_steps' if cfg.mode == 'async' else ''}")
    else:
        note = "the busier direction (full duplex)" + (", dense blocks included" if dense_step else "")
        n = servers_for(sparse, nic, V)
        while n < blocks and busiest(n) > nic:
            n += 1
        if busiest(n) > nic:                   # n >= blocks: the dense share is one block from here on
            n = max(n, servers_for(sparse, nic - floor, V))
    return _Network(to_srv, from_srv, busiest, Resource("network", sparse + dense, nic, "bytes/s", n, note))


def _checkpoint(rec: _Record, bench: BenchResults, K: float, share: float, record: int, servers: int,
                sketch: float) -> dict:
    """Base checkpoint bytes and the busiest server's save and restore seconds: ``servers`` servers, each
    also saving ``sketch`` bytes of admission sketches (0 without admission)."""
    save = rec.use(bench.figure("ckpt_save", "mb_per_s", unit="MB/s", need="base checkpoint write rate"))
    restore = rec.use(bench.figure("ckpt_restore", "mb_per_s", unit="MB/s", need="base checkpoint read rate"))
    bpr = rec.use(bench.figure("ckpt_save", "bytes_per_row", unit="bytes", need="checkpoint file bytes per row"))
    raw = rec.use(bench.figure("ckpt_save", "raw_bytes_per_row", unit="bytes", need="its rows' record bytes"))
    srv = rec.use(bench.figure("ckpt_save", "servers", unit="servers", required=False)
                  or Figure("ckpt_base_save.servers", 1, "servers", "assumption",
                            "ckpt_base_save records no servers: taken as 1"))
    per_row = rec.computed("ckpt_bytes_per_row", bpr * (record - 8) / raw, "bytes",
                           f"ckpt bytes_per_row x (record {record} - 8) / raw_bytes_per_row")
    rec.notes.append("checkpoint times use ckpt_bench's local-disk rates per server; a shared store (HDFS, S3) "
                     "whose aggregate bandwidth is lower binds instead")
    rows_bytes = K * per_row
    busiest = share * rows_bytes + sketch
    return {"base_bytes": rows_bytes + servers * sketch, "sketch_bytes": servers * sketch,
            "base_save_s": busiest / (save * 1e6 / srv), "restore_s": busiest / (restore * 1e6 / srv)}


def _check(ok: bool, msg: str, value) -> None:
    """Raise PlanInputError ``"{msg}, got {value}"`` unless ``ok`` and ``value`` (when a number) is finite:
    ``--keys inf`` passed ``> 0`` and ended in a traceback."""
    finite = not isinstance(value, float) or math.isfinite(value)
    if not (ok and finite):
        raise PlanInputError(f"{msg}{'' if finite else ' (a finite number)'}, got {value!r}")
