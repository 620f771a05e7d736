"""``engine plan CONFIG.yaml --keys 1e12 --examples-per-s N [--bench-results FILE] [--json] ...``.

Prints what a deployment of CONFIG's model needs for --keys rows of its sparse table at --examples-per-s
examples per second over all workers: servers by RAM, disk, pull and push throughput (and both on the same
cores) and network, which resource binds, and the resulting servers, RAM and disk per server and in
total, network per worker step and per server second, and base checkpoint save and restore times.

Figures come from a JSON-lines file of this machine's benchmark results (default
bench/results/this_machine.jsonl: the output of bench/table_bench.py, bench/ps_bench.py,
bench/ckpt_bench.py --backends local and bench/scale_bench.py), from the config, from the flags and from
the config's training data (unique keys per batch, unless --unique-keys-per-batch). Every input is
printed with its source; assumptions are marked as such. Formulas: ``engine.plan``.

The server defaults are this machine: its RAM, cores and free disk of the current directory; the network
is an assumed 10 Gb/s. GB means 10^9 bytes.

Exit codes: 0 a plan was printed (``feasible: false`` in --json, and a line saying why, when no number of
servers meets some resource), 2 bad input (config, flags, bench results file or line, a missing figure:
the bench, field and script are named) with one ``engine plan: ...`` line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="servers, RAM, disk, network and checkpoint time for a deployment",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config file")
    p.add_argument("--keys", type=float, required=True, metavar="N", help="rows of the sparse table, e.g. 1e12")
    p.add_argument("--examples-per-s", type=float, required=True, metavar="N",
                   help="training examples per second over all workers (word2vec: raw words per second)")
    p.add_argument("--bench-results", default=None, metavar="FILE",
                   help="JSON lines of benchmark results (default bench/results/this_machine.jsonl)")
    p.add_argument("--unique-keys-per-batch", type=float, default=None, metavar="N",
                   help="keys per worker batch after dedup (default: measured from the config's train data)")
    p.add_argument("--table", default=None, metavar="NAME",
                   help="the sparse table --keys counts (default model.sparse_table, or the only one)")
    p.add_argument("--server-ram-gb", type=float, default=None, metavar="GB",
                   help="RAM per server (default: this machine's)")
    p.add_argument("--server-disk-gb", type=float, default=None, metavar="GB",
                   help="disk per server for spilled rows (default: free space of the current directory)")
    p.add_argument("--server-cores", type=float, default=None, metavar="N",
                   help="cores per server (default: the cores this process may run on)")
    p.add_argument("--network-gbps", type=float, default=None, metavar="GBPS",
                   help="network per server and direction in Gb/s (default: an assumed 10)")
    p.add_argument("--ram-fraction", type=float, default=None, metavar="F",
                   help="share of the keys kept in RAM (default: the config's memory_rows budget when spill_path "
                        "is set, else an assumed 0.1)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes (adds each worker's network per second)")
    p.add_argument("--space-amplification", type=float, default=None, metavar="X",
                   help="disk bytes per record byte, compaction's peak included, when no "
                        "scale_summary.disk_bytes_per_row is measured (default: an assumed 1.2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.batch_size=512")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def run(args) -> int:
    from .. import plan
    from ..config import load_config
    from ..errors import ConfigError

    try:
        cfg = load_config(args.config, args.overrides)
        bench = plan.BenchResults.read(args.bench_results or plan.DEFAULT_BENCH_RESULTS)
        gb = {k: None if v is None else v * 1e9 for k, v in
              (("server_ram_bytes", args.server_ram_gb), ("server_disk_bytes", args.server_disk_gb))}
        result = plan.make_plan(
            cfg, bench, keys=args.keys, examples_per_s=args.examples_per_s,
            unique_keys_per_batch=args.unique_keys_per_batch, table=args.table, server_cores=args.server_cores,
            network_gbps=args.network_gbps, ram_fraction=args.ram_fraction, workers=args.workers,
            space_amplification=(plan.DEFAULT_SPACE_AMPLIFICATION if args.space_amplification is None
                                 else args.space_amplification), config_path=args.config, **gb)
    except ConfigError as e:
        print(f"engine plan: config error: {e}", file=sys.stderr)
        return 2
    except plan.PlanInputError as e:
        print(f"engine plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(render(result))
    return 0


# ------------------------------------------------------------------------------------ text
def si(x: float, unit: str = "", digits: int = 3) -> str:
    """``si(9.12e12, "B") == "9.12 TB"``; plain below 1000."""
    for scale, prefix in SI:
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


def duration(s: float) -> str:
    """Seconds as ``"42 s"``, ``"12.3 min"`` or ``"4.1 h"``."""
    return f"{s:.3g} s" if s < 120 else f"{s / 60:.3g} min" if s < 7200 else f"{s / 3600:.3g} h"


def _amount(x: float, unit: str) -> str:
    return {"bytes": lambda: si(x, "B"), "bytes/s": lambda: f"{si(x, 'B/s')} ({x * 8 / 1e9:.3g} Gb/s)",
            "keys/s": lambda: si(x) + " keys/s"}.get(unit, lambda: f"{x:.3g} {unit}")()


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(plan) -> str:
    """The plan as text: servers per resource, the deployment, the inputs with sources, the notes."""
    h, d, n = plan.header, plan.deployment, plan.servers
    value = {f.name: f.value for f in plan.inputs}
    out = [(f"engine plan {h['config']}: {value['keys']:.3g} keys of table {h['table']!r} (dim {h['dim']}, "
            f"{h['optimizer']}), {si(value['examples_per_s'])} {h['example']}/s, model {h['model']}, "
            f"mode {h['mode']}"),
           "",
           (f"Servers needed per resource (one server: {si(value['server_ram'], 'B')} RAM, "
            f"{si(value['server_disk'], 'B')} disk, {value['server_cores']:g} cores, "
            f"{value['server_network'] * 8 / 1e9:g} Gb/s)")]
    rows = [["resource", "demand", "per server", "servers", f"use at {n}", ""]]
    for r in plan.resources:
        rows.append([r.name, _amount(r.demand, r.unit), _amount(r.capacity, r.unit),
                     "-" if r.servers is None else str(r.servers), "" if r.use is None else f"{r.use:.0%}",
                     r.note])
    out += _table(rows)
    verdict = f"binding: {', '.join(plan.binding)} -> {n} servers"
    if not plan.feasible:
        bad = ", ".join(r.name for r in plan.resources if r.servers is None)
        verdict = f"NOT FEASIBLE: no number of servers meets {bad} (see its note); the rest: {verdict}"
    out += ["  " + verdict, "", f"Deployment ({n} servers; per server = the busiest, by vshard)"]
    net = d["network_per_step_per_worker_bytes"]
    ck = d["checkpoint"]
    pair = "{} / {}".format
    rows = [["keys per server", f"{d['keys_per_server']:.3g}"],
            ["rows in RAM per server", f"{d['rows_in_ram_per_server']:.3g} ({d['ram_share']:.3g} of its keys)"],
            ["RAM per server / total", pair(si(d["ram_per_server_bytes"], "B"), si(d["ram_total_bytes"], "B"))],
            ["disk per server / total", pair(si(d["disk_per_server_bytes"], "B"), si(d["disk_total_bytes"], "B"))],
            ["network per worker step",
             f"{si(net['to_servers'], 'B')} to servers, {si(net['from_servers'], 'B')} back"],
            ["network per server", _amount(d["network_per_server_bytes_per_s"], "bytes/s") + ", busier direction"],
            ["pull = push per server", _amount(d["pull_keys_per_s_per_server"], "keys/s")]]
    if "network_per_worker_bytes_per_s" in d:
        w = d["network_per_worker_bytes_per_s"]
        rows.append(["network per worker",
                     f"{_amount(w['to_servers'], 'bytes/s')} out, {_amount(w['from_servers'], 'bytes/s')} in"])
    save, restore = duration(ck["base_save_s"]), duration(ck["restore_s"])
    sk = f" (admission sketches {si(ck['sketch_bytes'], 'B')})" if ck.get("sketch_bytes") else ""
    rows.append(["base checkpoint", f"{si(ck['base_bytes'], 'B')}{sk}: save {save}, restore {restore}"])
    out += _table(rows)
    out += ["", "Inputs"]
    out += _table([["name", "value", "kind", "source"]] +
                  [[f.name, f"{f.value:.4g} {f.unit}", f.kind, f.source] for f in plan.inputs])
    if plan.notes:
        out += ["", "Notes"] + [f"  - {x}" for x in plan.notes]
    return "\n".join(out)
