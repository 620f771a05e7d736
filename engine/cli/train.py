"""``engine train CONFIG.yaml [--set key=value ...] [--role server|worker --rank N]``.

Without ``--role``: launch ``cluster.servers`` servers and ``cluster.workers`` workers on this machine
(free ports), run the job, stop everything, print one JSON line ``{"event": "final", ...}`` on stdout.
With ``--role``: run that one role in this process (multi-host; see ``engine.roles``).

With ``checkpoint.root`` set, the end of the job writes a checkpoint (its URI is the final line's
``checkpoint``); ``--resume [URI]`` restores one onto the servers before the workers start
(``engine.job_checkpoints``). A role that dies or hangs restarts the whole job from its newest complete
checkpoint, up to ``cluster.max_restarts`` times (``engine.launch.supervisor``); the final line says
how often (``restarts``) and how much work was done twice (``examples_replayed``).

SIGTERM (to the launcher or to any role) is a preemption (``engine.preempt``): the job writes a checkpoint
at its next meeting, within ``cluster.preempt_timeout_s``, and stops; ``--resume`` continues from there.

Exit codes: 0 success, 2 bad config, arguments or input data (in role mode every CTR worker, when any
worker's check of its share of the inputs before the first step found a bad value; a training input's
store refusing the credentials), 1 the job failed (more failures than ``cluster.max_restarts`` allows,
every one listed), a checkpoint could not be restored, or the checkpoint storage or a training input's
store (``model.data`` by URI: ``training input URI: ...``) stayed unreachable through its retries (one
line each, no traceback), 69 ``--launcher ray`` could not place the roles within
``cluster.startup_timeout_s``: no live Ray node offers a role's resources, e.g. its node was lost and none
replaced it (one line naming the role and resources, and the command that continues the job), 74 the checkpoint storage refuses writes for good (read-only, access refused,
full: no restart mends it; one resumable line), 75 preempted (resumable: ``engine train CONFIG
--resume``), 76 (a ``--role worker`` whose servers restarted, restored or were fenced under it, or that
lost one, or one of which did not answer in time: restart it), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from hdfs_io import PERMANENT_MARKER, CheckpointCorruptError, NotPublishedError, StorageError, permanent_failure
from sparse_tables import TableConfigError
from streaming.errors import ConvertError, DataFormatError, SchemaError
from streaming.inputs import InputUnavailableError

from .. import preempt
from ..errors import (EXIT_NO_RESOURCES, EXIT_STORAGE_REFUSED, REFUSED_ENDS, ConfigError, LaunchError, PlacementError,
                      ProtocolVersionError)

log = logging.getLogger("engine.train")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model from a YAML config (launches servers and workers)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set mode=sync --set cluster.workers=3")
    p.add_argument("--role", choices=("server", "worker"), default=os.environ.get("ENGINE_ROLE"),
                   help="run one role only (default: launch all locally; env ENGINE_ROLE)")
    p.add_argument("--rank", type=int, default=None,        # ENGINE_RANK is read in run(): garbage in it
                   help="rank of this role (env ENGINE_RANK)")   # broke every command's parser
    p.add_argument("--host", default=None, help="server bind address, and a worker's health port's "
                   "(default cluster.host)")
    p.add_argument("--port", type=int, default=None, help="server port (0: pick a free port)")
    p.add_argument("--ready-file", default=None, help="server: write host:port here once listening")
    p.add_argument("--result-file", default=None, help="worker: write the JSON summary here")
    p.add_argument("--run-dir", default=None, help="launcher: directory for logs and results")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="URI",
                   help="restore a checkpoint before training: URI of a checkpoint directory or job root "
                        "(default: the newest complete checkpoint under checkpoint.root)")
    p.add_argument("--launcher", choices=("local", "ray"), default=None,
                   help="start the roles as local processes or Ray actors (default cluster.launcher)")
    p.add_argument("--health-port", type=int, default=None, metavar="N",
                   help="serve gRPC health checking (plaintext, nothing else) on port N: a server's "
                        "readiness and liveness (default cluster.health_port), a worker's liveness (a loop "
                        "stalled past client.dead_after_s is NOT_SERVING; default off); -1 off, 0 a free port")
    p.add_argument("--allow-load", action="append", default=[], metavar="URI",
                   help="server: clients may also load checkpoints below URI (besides checkpoint.root); "
                        "the launcher passes its --resume URI")
    p.add_argument("--resume-id", default=None, metavar="ID",
                   help="server with --resume URI (engine k8s renders it): checkpoints record ID and URI, and a "
                        "server restarted with the same arguments restores the job's newest checkpoint when it "
                        "records them, instead of URI again")
    p.add_argument("--resume-fallback", action="store_true",
                   help="with --resume: a damaged checkpoint falls back to the previous complete one")
    p.add_argument("--until", default=None, metavar="YYYYMMDDHH",
                   help="online jobs: stop before the first hourly partition at or after this hour "
                        "(the same as --set model.until=YYYYMMDDHH)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args) -> int:
    error = _role_from_env(args)
    if error:
        print(f"engine train: config error: {error}", file=sys.stderr)
        return 2
    if args.role not in ("server", "worker"):       # the launcher (ENGINE_ROLE may be set empty)
        return _run(args)
    code, error = 1, None
    try:
        code = _run(args)
    except BaseException as e:
        error = e
        if isinstance(e, SystemExit):           # sys.exit(N) inside: the process exits with N
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        if args.role == "worker" and "mpi4py.MPI" in sys.modules:   # mode hybrid: a failed rank ends
            from ..allreduce import end_world                      # its MPI world at once, after
            end_world(code, error)                                    # logging why (the abort ends the
        _end_role_process()                                           # process before Python would)
    return code


def _role_from_env(args) -> str | None:
    """Complete ``args.rank`` from ``ENGINE_RANK`` (default 0) and check an ``ENGINE_ROLE`` the parser took
    as ``--role``'s default; returns what is wrong with them, or None. An ``ENGINE_ROLE`` of ``serve`` ran
    the launcher without a word; an ``ENGINE_RANK`` of ``x`` broke every ``engine`` command's parser."""
    if args.role not in (None, "", "server", "worker"):
        return f"ENGINE_ROLE must be server or worker (or empty: the launcher), got {args.role!r}"
    if args.rank is None:
        raw = os.environ.get("ENGINE_RANK", "0")
        try:
            args.rank = int(raw)
        except ValueError:
            return f"ENGINE_RANK must be an int, got {raw!r}"
    return None


def resume_command(args, *, resume: str | None = "") -> str:
    """The command line that continues this launcher's job from its newest checkpoint: the same config,
    ``--set`` overrides, ``--launcher`` and ``--until`` (``checkpoint.root``/``job`` may be among the
    overrides: without them ``--resume`` would look in another job's root), then ``--resume``. An inline
    storage secret given with ``--set`` (``StorageConfig.SECRETS``) is not repeated (the line goes to logs):
    its value reads ``<as before>``. ``resume``: "" ends the line with ``--resume``, a URI with ``--resume
    URI``, None with neither (the job's own command, to run it again)."""
    import shlex

    from ..config import StorageConfig
    secret = {f"storage.{k}" for k in StorageConfig.SECRETS}
    cmd = ["engine", "train", args.config]
    for kv in args.overrides:
        key = kv.split("=", 1)[0].strip()
        cmd += ["--set", f"{key}=<as before>" if key in secret else kv]
    if args.launcher:
        cmd += ["--launcher", args.launcher]
    if args.until:
        cmd += ["--until", args.until]
    return shlex.join(cmd + ([] if resume is None else ["--resume"] + ([resume] if resume else [])))


def _check_flags(args) -> None:
    """Refuse a port outside its range and a file flag whose directory does not exist, before anything
    starts: gRPC bound ``--port 99999`` as 34463 (the port modulo 2^16) without a word, and a
    ``--ready-file`` or ``--result-file`` in a missing directory ended the role with a traceback once it
    was listening or had trained.

    Raises
    ------
    ConfigError
        Names the flag and the value.
    """
    if args.port is not None and not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535] (0: a free port), got {args.port}")
    if args.health_port is not None and not -1 <= args.health_port <= 65535:
        raise ConfigError(f"--health-port must be in [-1, 65535] (-1: off, 0: a free port), got {args.health_port}")
    for flag, path in (("--ready-file", args.ready_file), ("--result-file", args.result_file)):
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise ConfigError(f"{flag} {path}: its directory {parent} does not exist")


def _make_run_dir(path: str, key: str) -> None:
    """Create the launcher's run directory (or the root it makes one in) now, so one that cannot be made
    (a file, a missing or read-only parent) is a config error naming ``key`` rather than a
    FileExistsError/FileNotFoundError traceback from the launcher.

    Raises
    ------
    ConfigError
        ``path`` cannot be made a directory (the OS error named).
    """
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        why = ("exists and is not a directory" if isinstance(e, FileExistsError) else
               f"cannot create it: {e.strerror or e}")
        raise ConfigError(f"{key} {path}: {why}") from None


def _end_role_process() -> None:
    """Shorten the end of a role process (``--role``, always a process of its own) to its last flush.

    Its health port closes with the role, and a liveness probe that finds the port closed while the
    process still lives counts a failure: with enough of them a finished worker is restarted into a job
    that has ended. Nearly all of that gap is the interpreter's finalization, whose full garbage
    collection over every object the role made took 0.45-0.7 s on a 2-core machine (idle, then with two
    busy processes beside it; over 2 s on CI once, where a test's 1 s x 3 probe restarted a
    worker that had finished). ``gc.freeze()`` moves those objects out of its reach: the same end took
    0.045 s. The memory goes back with the process. What the collection would have finalized is
    cyclic garbage only; the role closed its client, report, ports, metrics and result file explicitly
    before this, and the atexit handlers (logging's flush) and the standard streams' flush still run.
    Instagram ended its web workers the same way for the same cost ("Dismissing Python Garbage
    Collection at Instagram", 2017). Never call it in a process that goes on."""
    import gc
    gc.freeze()


def _run(args) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s {args.role or 'launcher'}{'' if not args.role else args.rank} "
                               f"%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from ..config import load_config
    overrides = (list(args.overrides) + ([f"model.until={args.until}"] if args.until else [])
                 + ([f"cluster.launcher={args.launcher}"] if args.launcher else []))
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"engine train: config error: {e}", file=sys.stderr)
        return 2
    from .. import roles
    try:
        if args.resume_fallback and args.resume is None:
            raise ConfigError("--resume-fallback: only with --resume (it picks the checkpoint --resume restores "
                              "when the newest is damaged); without --resume the job starts fresh")
        _check_flags(args)
        if args.resume_id is not None and args.role != "server":
            raise ConfigError("--resume-id: only for --role server with --resume URI (a launcher restarts "
                              "from the job's newest checkpoint by itself)")
        if args.role == "server":
            roles.guard_parent()
            return roles.run_server(cfg, args.rank, host=args.host, port=args.port, ready_file=args.ready_file,
                                    resume=args.resume, resume_fallback=args.resume_fallback,
                                    allow_load=args.allow_load, health_port=args.health_port,
                                    resume_id=args.resume_id)
        if args.role == "worker":
            roles.guard_parent()
            preempt.install_handler()        # SIGTERM: checkpoint at the next meeting, then exit 75
            result = roles.run_worker(cfg, args.rank, result_file=args.result_file, host=args.host,
                                      health_port=args.health_port)
            if result.get("rollback"):
                return roles.EXIT_ROLLBACK
            return preempt.EXIT_PREEMPTED if result.get("preempted") else 0
        if cfg.model is None:
            raise ConfigError("model: missing; set model.kind to a worker program (e.g. logreg)")
        from ..launch.supervisor import run_job
        from ..programs import load_program
        from ..security.listen import check_listen
        check_listen(cfg.cluster.host, cfg.security)   # before prepare reads, converts or records any input
        if cfg.cluster.launcher == "ray":
            from ..launch.ray import require_ray
            require_ray()                               # so too a missing Ray: one line, exit 2, nothing done
        program = load_program(cfg.model.kind)
        if hasattr(program, "prepare"):
            cfg = program.prepare(cfg)
        if args.run_dir:
            _make_run_dir(args.run_dir, "--run-dir")
        else:
            _make_run_dir(cfg.cluster.run_root, "cluster.run_root")
        final = run_job(cfg, program, args.run_dir, resume=args.resume, resume_fallback=args.resume_fallback)
        if final.get("preempted"):
            print(json.dumps(final), flush=True)
            print(f"engine train: preempted; resume with: {resume_command(args)} "
                  f"(checkpoint {final.get('checkpoint')})", file=sys.stderr)
            return preempt.EXIT_PREEMPTED
    except ConfigError as e:
        print(f"engine train: config error: {e}", file=sys.stderr)
        return 2
    except (DataFormatError, SchemaError, ConvertError) as e:
        print(f"engine train: bad input data: {e}", file=sys.stderr)
        return 2
    except TableConfigError as e:       # e.g. a spill directory that is not ours, or in use
        print(f"engine train: table error: {e}", file=sys.stderr)
        return 2
    except ProtocolVersionError as e:    # roles of two engine versions: restarting it does not help
        print(f"engine train: {e}", file=sys.stderr)
        return 2
    except PlacementError as e:         # Ray: no live node offers a role's resources (a lost node not replaced)
        then = (f"once a Ray node offers them, run it again: {resume_command(args, resume=None)}" if e.resume is None
                else f"the job's checkpoints are kept: once a Ray node offers them, continue with: "
                     f"{resume_command(args, resume=e.resume)}")
        print(f"engine train: {e}; {then}", file=sys.stderr)
        return EXIT_NO_RESOURCES
    except LaunchError as e:
        print(f"engine train: failed: {e}", file=sys.stderr)
        return 2 if e.exit_code == 2 else 1     # a role's config or bad-input error: not restarted
    except (CheckpointCorruptError, NotPublishedError) as e:
        print(f"engine train: cannot resume: {e}", file=sys.stderr)
        return 1
    except InputUnavailableError as e:  # model.data's store (s3://, hdfs://), not the checkpoints'
        if getattr(e, "refused", None):  # access denied, bad or expired credentials: a restart meets it again
            then = (f"run it again: {resume_command(args, resume=args.resume)}" if not args.role else
                    "start the job's roles again")
            print(f"engine train: {e}; no restart mends that, so the job ends here: once the storage section's "
                  f"credentials (storage.access_key, secret_key, session_token, or the AWS_* environment) and the "
                  f"bucket's policy let the job read its inputs, {then}", file=sys.stderr)
            return 2
        then = (f"the job did not start; once the storage answers, run it again: "
                f"{resume_command(args, resume=args.resume)}" if not args.role else
                "this role stops; its launcher or scheduler restarts it from the newest checkpoint")
        print(f"engine train: {e}; {then}", file=sys.stderr)
        return 1
    except StorageError as e:           # unreachable after hdfs_io's retries (e.g. at a restart's look-up)
        refused = permanent_failure(e) or getattr(e, "refused", None)
        if refused:                     # read-only, access refused, full: each restart would fail the same way
            then = (f"continue with: {resume_command(args)}" if not args.role else
                    "start the job's roles again (its servers with --resume)")
            mark = "" if PERMANENT_MARKER in str(e) else f" [{PERMANENT_MARKER}: {refused}]"
            print(f"engine train: checkpoint storage failed: {e}{mark}; {REFUSED_ENDS} (a read-only, refused or "
                  f"full storage): what the newest complete checkpoint holds is kept; once the storage takes "
                  f"writes again, {then}", file=sys.stderr)
            return EXIT_STORAGE_REFUSED
        then = (f"continue with: {resume_command(args)}" if not args.role else
                "its scheduler restarts this role")
        if getattr(e, "nothing_trained", False):        # the job never started training: the same command
            then = f"run it again: {resume_command(args, resume=args.resume)}"
        print(f"engine train: checkpoint storage failed: {e}; what the newest complete checkpoint holds is "
              f"kept: once the storage answers, {then}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("engine train: interrupted; every process was stopped", file=sys.stderr)
        return 130
    print(json.dumps(final), flush=True)
    return 0
