"""``engine status``: a live view of a running cluster, from the servers' ``Stats`` RPC and the workers'
progress files, with no Prometheus needed.

Where it looks (``resolve``):

* a run directory (the local launcher's, ``engine.launch.local``): ``endpoints.json`` names the servers,
  ``config.yaml`` the security settings (TLS and tokens are read from the files or variables the config
  names, as every role does), ``worker-N.progress.json`` each worker's progress (``engine.progress``).
  When the run restarted (``restart-K/`` below it), the newest attempt is shown.
* ``host:port,host:port``: those servers only (no worker view); ``config`` gives their security.
* nothing: the newest local run, ``{cluster.run_root}/latest`` (default ``runs/run/latest``).

What it shows (``table``: one snapshot computed from two samples ``dt`` seconds apart)::

    servers  rank, endpoint, rows, rows in RAM, rows on disk, RAM of the tables, RSS of the process,
             disk bytes, requests/s, p99 latency (data requests: Pull/Push/Step/Dense/Metric, handling
             time on the server, from the Stats latency histogram of the interval), errors, whether it
             is stuck (``engine.ps.watchdog``: why, shown in red) and its oldest request's time, a spill
             store that stopped writing for good (``spill_failed``: which shard and why, in red); a server
             that does not answer within ``timeout_s`` is {"status": "unreachable", "error": ...}, one
             that refuses the call (a wrong token or certificate) {"status": "error", "error": ...}
    workers  rank, pid, step (the job's: a resumed checkpoint's step plus this process's, which is
             ``process_steps``), steps/s, examples/s, epoch or partition (``where``, else the last mark),
             phase (``exited`` when its process is gone), seconds since the last heartbeat; and
             ``launcher_alive`` (False: the run is over, what is shown is its last state)

Rates and the p99 are differences of two reads (server counters over wall time; worker counters over
their own heartbeat times): the first frame, with one read, shows none (it used to show the p99 of the
server's whole life). Requests/s leaves out ``Stats`` and ``Health`` (this view and the launcher's watch).
The p99 is a quantile of a fixed-bucket histogram, interpolated linearly within its bucket (as
Prometheus's ``histogram_quantile``); its resolution is the bucket (``LATENCY_BOUNDS_S``).
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .. import progress
from ..errors import ConfigError

#: requests counted in requests/s and p99 (the rest is monitoring or rare admin work)
DATA_METHODS = ("Pull", "Push", "Step", "Dense", "Metric")
MONITORING = ("Stats", "Health")
ENDPOINTS_FILE = "endpoints.json"
DEFAULT_ROOT = "runs/run"


@dataclass
class Target:
    """What ``engine status`` watches: ``endpoints`` (``host:port`` in rank order), the run directory
    (None for an endpoint list) and the run's config (None: plaintext, no tokens)."""

    endpoints: list[str]
    run_dir: Path | None = None
    cfg: object | None = None
    workers: int = 0
    launcher_pid: int | None = None
    label: str = ""
    notes: list[str] = field(default_factory=list)


def _attempt_dir(run_dir: Path) -> Path:
    """The newest attempt of a run: ``run_dir/restart-K`` with the largest K that has endpoints, else
    ``run_dir``."""
    restarts = []
    for d in run_dir.glob("restart-*"):
        try:
            restarts.append((int(d.name.split("-", 1)[1]), d))
        except ValueError:
            continue
    for _, d in sorted(restarts, reverse=True):
        if (d / ENDPOINTS_FILE).is_file():
            return d
    return run_dir


def resolve(target: str | None, *, root: str = DEFAULT_ROOT, config: str | None = None) -> Target:
    """The ``Target`` of ``engine status TARGET`` (module docstring).

    Parameters
    ----------
    target : str or None
        A run directory, ``host:port[,host:port...]``, or None/"" for ``root/latest``.
    root : str
        The launcher's ``cluster.run_root``.
    config : str, optional
        A config file whose ``security`` section to use (default: the run directory's ``config.yaml``).

    Raises
    ------
    ConfigError
        No run under ``root``; a directory without ``endpoints.json`` (not a run directory, or its
        servers are not ready yet); a malformed endpoint; an unreadable config (the path is named).
    """
    from ..config import load_config

    cfg = load_config(config) if config else None
    if not target:
        latest = Path(root) / "latest"
        if not latest.exists():
            raise ConfigError(f"engine status: no local run found ({latest} does not exist); give a run "
                              f"directory or host:port endpoints, or --root (the config's cluster.run_root)")
        target = str(latest.resolve())
    path = Path(target)
    if path.is_dir():
        run_dir = _attempt_dir(path.resolve())
        ep_file = run_dir / ENDPOINTS_FILE
        if not ep_file.is_file():
            raise ConfigError(f"engine status: {ep_file} not found: {path} is not a run directory of the local "
                              f"launcher, or its servers are not ready yet")
        try:
            info = json.loads(ep_file.read_text())
            endpoints = [str(e) for e in info["endpoints"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"engine status: {ep_file}: unreadable ({e})") from None
        if cfg is None and (run_dir / "config.yaml").is_file():
            cfg = load_config(run_dir / "config.yaml")
        return Target(endpoints, run_dir, cfg, int(info.get("workers", 0)), info.get("launcher_pid"),
                      label=str(run_dir))
    endpoints = [e.strip() for e in target.split(",") if e.strip()]
    bad = [e for e in endpoints if not _is_endpoint(e)]
    if not endpoints or bad:
        raise ConfigError(f"engine status: {target!r} is neither a directory nor host:port endpoints "
                          f"(bad: {', '.join(bad) or 'empty'})")
    return Target(endpoints, None, cfg, label=",".join(endpoints),
                  notes=["servers only: give the run directory to see the workers"])


def _is_endpoint(endpoint: str) -> bool:
    from ..config import check_endpoint
    try:
        check_endpoint(endpoint, "endpoint")
    except ConfigError:
        return False
    return True


class Sampler:
    """Reads the raw state of a ``Target``: every server's ``Stats`` (in parallel, each call with a
    deadline of ``timeout_s`` seconds and no retry) and every worker's progress file.

    Raises
    ------
    ConfigError
        The run's security files or variables cannot be read (``engine.security.credentials``).
    """

    def __init__(self, target: Target, timeout_s: float = 2.0):
        from ..ps.transport import GrpcTransport
        from ..security.credentials import client_security

        self.target, self.timeout_s = target, float(timeout_s)
        security = client_security(self.target.cfg.security) if self.target.cfg is not None else None
        kwargs = {"max_message_bytes": target.cfg.server.max_message_bytes} if target.cfg is not None else {}
        self._transport = GrpcTransport(target.endpoints, retries=0, security=security, **kwargs)
        self._pool = ThreadPoolExecutor(max(1, min(16, len(target.endpoints))), thread_name_prefix="status")
        self._n = 0

    def _stats(self, i: int) -> dict:
        from ..ps import ps_pb2 as pb

        self._n += 1
        try:
            r = self._transport.call(i, "Stats", pb.Empty(request_id=f"status-{i}-{self._n}"), self.timeout_s)
            return {"ok": True, "stats": json.loads(r.json)}
        except Exception as e:  # noqa: BLE001 - any failure is this server's entry, never the view's end
            code = getattr(e, "code", None)
            return {"ok": False, "status": "unreachable" if code in (None, "UNAVAILABLE", "DEADLINE_EXCEEDED")
                    else "error", "error": " ".join(str(e).split())[:300]}

    def sample(self) -> dict:
        """``{"time": wall s, "mono": monotonic s, "servers": [{"ok", "stats" | "error"}], "workers": {rank:
        report}}``. Rates divide by the ``mono`` interval (a step of the wall clock between two samples
        is no interval); ``time`` is shown and ages workers' wall-clock beats."""
        now, mono = time.time(), time.monotonic()
        servers = list(self._pool.map(self._stats, range(len(self.target.endpoints))))
        workers = {}
        if self.target.run_dir is not None:
            for f in sorted(self.target.run_dir.glob("worker-*.progress.json")):
                try:
                    rank = int(f.name.split(".", 1)[0].split("-", 1)[1])
                except ValueError:
                    continue
                rep = progress.read(f)
                if rep is not None:
                    workers[rank] = rep
        return {"time": now, "mono": mono, "servers": servers, "workers": workers}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._transport.close()


def quantile(bounds: list[float], counts: list[int], q: float) -> float | None:
    """The ``q`` quantile of a histogram with bucket upper ``bounds`` (seconds; ``counts`` has one more
    entry, the +inf bucket), linear within the bucket; None without observations. A quantile in the +inf
    bucket reports its lower bound (the largest finite one)."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(bounds):
                return float(bounds[-1])
            lo = bounds[i - 1] if i > 0 else 0.0
            return lo + (bounds[i] - lo) * (rank - seen) / c
        seen += c
    return float(bounds[-1])


def _data_histogram(stats: dict) -> list[int]:
    lat = stats.get("latency", {})
    n = len(stats.get("latency_bounds_s", [])) + 1
    return [sum(lat.get(m, [0] * n)[j] for m in DATA_METHODS) for j in range(n)]


def _server_row(i: int, endpoint: str, cur: dict, prev: dict | None, dt: float) -> dict:
    if not cur["ok"]:
        return {"server": i, "endpoint": endpoint, "status": cur["status"], "error": cur["error"]}
    st = cur["stats"]
    tables = {n: {k: t.get(k) for k in ("rows", "rows_in_ram", "rows_spilled", "ram_bytes", "disk_bytes")}
              for n, t in st.get("sparse", {}).items()}
    row = {"server": st.get("server", i), "endpoint": endpoint, "status": "ok",
           "rows": sum(t["rows"] or 0 for t in tables.values()),
           "rows_in_ram": sum(t["rows_in_ram"] or 0 for t in tables.values()),
           "rows_on_disk": sum(t["rows_spilled"] or 0 for t in tables.values()),
           "table_ram_bytes": sum(t["ram_bytes"] or 0 for t in tables.values()),
           "disk_bytes": sum(t["disk_bytes"] or 0 for t in tables.values()),
           "rss_bytes": st.get("rss_bytes"), "pid": st.get("pid"), "uptime_s": st.get("uptime_s"),
           "requests_total": sum(v for m, v in st.get("requests", {}).items() if m not in MONITORING),
           "errors": st.get("errors"), "requests_per_s": None, "p99_latency_s": None, "tables": tables,
           "stuck": st.get("stuck"), "oldest_request_s": st.get("oldest_request_s"),
           "spill_failed": st.get("spill_failed")}
    hist = _data_histogram(st)
    if prev is not None and prev["ok"] and prev["stats"].get("uptime_s", 0) <= st.get("uptime_s", 0):
        old = prev["stats"]
        before = sum(v for m, v in old.get("requests", {}).items() if m not in MONITORING)
        row["requests_per_s"] = max(0, row["requests_total"] - before) / dt if dt > 0 else None
        old_hist = _data_histogram(old)
        if len(old_hist) == len(hist) and st.get("latency_bounds_s"):    # the interval's, as the rates
            row["p99_latency_s"] = quantile(st["latency_bounds_s"], [a - b for a, b in zip(hist, old_hist)], 0.99)
    return row


def _alive(pid) -> bool | None:
    """Whether process ``pid`` of this host runs (None: unknown)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:          # exists, but not ours to signal
        return True
    return True


def _worker_row(rank: int, cur: dict, prev: dict | None, now: float) -> dict:
    where = dict(cur.get("where") or {})
    # step: the job's (the resumed checkpoint's step plus this process's steps; rates use the latter)
    row = {"rank": rank, "pid": cur.get("pid"), "alive": _alive(cur.get("pid")),
           "step": int(cur.get("step_base") or 0) + int(cur.get("step") or 0), "process_steps": cur.get("step"),
           "examples": cur.get("examples"),
           "epoch": where.get("epoch"), "partition": where.get("partition"), "where": where,
           "last_mark": cur.get("last_mark"), "phase": (cur.get("phase") or {}).get("name"),
           # now is taken before the files are read: a beat written since is 0 s old, not negative
           "beat_age_s": max(0.0, now - float(cur.get("beat", now))), "steps_per_s": None, "examples_per_s": None}
    if prev is not None and prev.get("pid") == cur.get("pid"):
        dt = float(cur.get("beat", 0)) - float(prev.get("beat", 0))
        if dt > 0:
            row["steps_per_s"] = max(0, cur.get("step", 0) - prev.get("step", 0)) / dt
            row["examples_per_s"] = max(0, cur.get("examples", 0) - prev.get("examples", 0)) / dt
    return row


def table(target: Target, cur: dict, prev: dict | None) -> dict:
    """One snapshot (the ``--json`` object) from the samples ``cur`` and ``prev`` (None: no rates)."""
    dt = (cur.get("mono", cur["time"]) - prev.get("mono", prev["time"])) if prev is not None else 0.0
    servers = [_server_row(i, ep, cur["servers"][i], prev["servers"][i] if prev else None, dt)
               for i, ep in enumerate(target.endpoints)]
    workers = [_worker_row(r, rep, (prev or {}).get("workers", {}).get(r), cur["time"])
               for r, rep in sorted(cur["workers"].items())]
    return {"target": target.label, "run_dir": str(target.run_dir) if target.run_dir else None,
            "launcher_alive": _alive(target.launcher_pid) if target.run_dir else None,
            "time": cur["time"], "interval_s": dt, "servers": servers, "workers": workers,
            "expected_workers": target.workers, "notes": target.notes}


def _si(v, unit: str = "") -> str:
    if v is None:
        return "-"
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= f:
            return f"{v / f:.1f}{p}{unit}"
    return f"{v:.0f}{unit}" if isinstance(v, int) or float(v).is_integer() else f"{v:.1f}{unit}"


def _bytes(v) -> str:
    if v is None:
        return "-"
    for f, p in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if v >= f:
            return f"{v / f:.1f} {p}"
    return f"{v} B"


def render(snap: dict):
    """rich renderable of a snapshot: a servers table and a workers table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"engine status  {snap['target']}  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}"
                + ("  (launcher exited: the run is over)" if snap.get("launcher_alive") is False else ""),
                style="bold")
    st = Table(title="servers", title_justify="left", expand=False)
    for c in ("rank", "endpoint", "rows", "in RAM", "on disk", "table RAM", "RSS", "disk", "req/s",
              "p99", "errors"):
        st.add_column(c, justify="left" if c == "endpoint" else "right")
    errors = []
    for s in snap["servers"]:
        if s["status"] != "ok":
            st.add_row(str(s["server"]), s["endpoint"], Text(s["status"], style="bold red"), *[""] * 8)
            errors.append(Text(f"server {s['server']} ({s['endpoint']}) {s['status']}: {s['error']}", style="red"))
            continue
        if s.get("stuck"):        # engine.ps.watchdog: its health port says NOT_SERVING
            errors.append(Text(f"server {s['server']} ({s['endpoint']}) stuck: {s['stuck']}", style="bold red"))
        if s.get("spill_failed"):     # PSServer.spill_failed: not live, its shard refuses every request
            errors.append(Text(f"server {s['server']} ({s['endpoint']}) not live, spill store failed: "
                               f"{s['spill_failed']}", style="bold red"))
        p99 = s["p99_latency_s"]
        st.add_row(str(s["server"]), s["endpoint"], _si(s["rows"]), _si(s["rows_in_ram"]), _si(s["rows_on_disk"]),
                   _bytes(s["table_ram_bytes"]), _bytes(s["rss_bytes"]), _bytes(s["disk_bytes"]),
                   "-" if s["requests_per_s"] is None else f"{s['requests_per_s']:.0f}",
                   "-" if p99 is None else f"{p99 * 1e3:.2f} ms", str(s["errors"]))
    parts = [head, st, *errors]
    if snap["run_dir"] is not None:
        wt = Table(title="workers", title_justify="left", expand=False)
        for c in ("rank", "pid", "step", "steps/s", "examples/s", "epoch / partition", "phase", "beat age"):
            wt.add_column(c, justify="right" if c not in ("phase", "epoch / partition") else "left")
        for w in snap["workers"]:
            where = (f"epoch {w['epoch']}" if w["epoch"] is not None else
                     f"partition {w['partition']}" if w["partition"] is not None else
                     f"after {w['last_mark']}" if w["last_mark"] else "-")
            age = w["beat_age_s"]
            wt.add_row(str(w["rank"]), str(w["pid"]), str(w["step"]),
                       "-" if w["steps_per_s"] is None else f"{w['steps_per_s']:.1f}",
                       "-" if w["examples_per_s"] is None else f"{w['examples_per_s']:.0f}", where,
                       "exited" if w["alive"] is False else (w["phase"] or "training"), Text(f"{age:.1f} s", style="red" if age > 5 else ""))
        if not snap["workers"]:
            wt.add_row("-", "", "", "", "", "no progress files yet", "", "")
        parts.append(wt)
    for n in snap["notes"]:
        parts.append(Text(n, style="dim"))
    return Group(*parts)


def once(target: Target, interval_s: float = 1.0, timeout_s: float = 2.0) -> dict:
    """One snapshot with rates over ``interval_s`` seconds (two samples)."""
    sampler = Sampler(target, timeout_s)
    try:
        prev = sampler.sample()
        time.sleep(interval_s)
        return table(target, sampler.sample(), prev)
    finally:
        sampler.close()


def live(target: Target, interval_s: float = 1.0, timeout_s: float = 2.0, console=None) -> None:
    """Refresh the view every ``interval_s`` seconds until Ctrl-C (``rich.live.Live``)."""
    from rich.live import Live

    sampler = Sampler(target, timeout_s)
    try:
        prev = sampler.sample()
        with Live(render(table(target, prev, None)), console=console, refresh_per_second=4,
                  auto_refresh=False) as view:
            while True:
                time.sleep(interval_s)
                cur = sampler.sample()
                view.update(render(table(target, cur, prev)), refresh=True)
                prev = cur
    except KeyboardInterrupt:
        pass
    finally:
        sampler.close()
