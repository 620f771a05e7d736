"""``engine status [TARGET] [--once] [--json] [--interval S] [--timeout S] [--root DIR] [--config FILE]``.

A live view of a running cluster, refreshed every second until Ctrl-C: per server (its ``Stats`` RPC) the
rows in RAM and on disk, memory, requests/s and p99 latency; per worker (its progress file in the run
directory) steps/s, examples/s and the current epoch or partition. TARGET is a run directory of the local
launcher (``engine train`` logs it: ``run directory: ...``), ``host:port,host:port``, or nothing for the
newest local run (``--root``/latest, default ``runs/run/latest``). Works without Prometheus; a secured
run is reached with the run's config (``config.yaml`` in the run directory, or ``--config``), its token
and certificate files or variables.

``--once`` prints one snapshot (rates over ``--interval`` seconds) and exits; with ``--json`` it is one
JSON object for scripts (``engine.observability.status.table``)::

    {"target": ..., "run_dir": ..., "time": ..., "interval_s": 1.0,
     "servers": [{"server": 0, "endpoint": "127.0.0.1:4321", "status": "ok", "rows": 1000,
                  "rows_in_ram": 1000, "rows_on_disk": 0, "table_ram_bytes": ..., "rss_bytes": ...,
                  "disk_bytes": 0, "requests_per_s": 12.0, "p99_latency_s": 0.0007, "errors": 0,
                  "tables": {"emb": {"rows": 1000, ...}}, ...},
                 {"server": 1, "endpoint": "127.0.0.1:4322", "status": "unreachable", "error": "..."}],
     "workers": [{"rank": 0, "step": 120, "steps_per_s": 35.2, "examples_per_s": 4505.6, "epoch": 0,
                  "phase": null, "beat_age_s": 0.2, ...}]}

Exit codes: 0 (also when some server is unreachable: that is reported per server), 1 no server
answered in ``--once`` mode, 2 bad input (no run found, not a run directory, bad endpoints, unreadable
security files) with one ``engine status: ...`` line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="live view of a running cluster (servers' rows, requests, latency; "
                                      "workers' steps/s)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default=None,
                   help="run directory, or host:port[,host:port...] (default: the newest local run)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: one JSON object")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between refreshes (and between the two samples of --once)")
    p.add_argument("--timeout", type=float, default=2.0, metavar="S", help="deadline of each Stats call")
    p.add_argument("--root", default=None, metavar="DIR",
                   help="where the local launcher makes run directories (cluster.run_root; default runs/run)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config whose security section to use (default: the run directory's config.yaml)")


def run(args) -> int:
    from ..observability import status

    try:
        from ..config_base import MAX_SECONDS
        for flag, value in (("--interval", args.interval), ("--timeout", args.timeout)):
            if not 0 < value <= MAX_SECONDS:      # nan and 1e308 ended in a traceback from time.sleep
                raise ConfigError(f"{flag} must be in (0, {MAX_SECONDS:.0f}] seconds, got {value:g}")
        if args.json and not args.once:
            raise ConfigError("--json needs --once (the live view is for terminals)")
        target = status.resolve(args.target, root=args.root or status.DEFAULT_ROOT, config=args.config)
        if args.once:
            snap = status.once(target, args.interval, args.timeout)
        else:
            status.live(target, args.interval, args.timeout)
            return 0
    except ConfigError as e:
        msg = str(e)
        print(msg if msg.startswith("engine status") else f"engine status: {msg}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(snap, default=str))
    else:
        from rich.console import Console
        Console().print(status.render(snap))
    return 0 if any(s["status"] == "ok" for s in snap["servers"]) else 1

