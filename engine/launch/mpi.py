"""Hybrid-mode workers as one MPI world: the local launcher's ``mpiexec`` (MPICH's hydra, fork launcher,
no ssh) and what it tells the launcher about each rank.

``LocalCluster.start_workers`` in mode hybrid starts one process::

    mpiexec -launcher fork -n W  python -m engine.launch.mpi RUN_DIR/mpi-world.json

Each of the W processes is this module's ``main``, a shim (``_rank_shim``): it reads its rank from
hydra's ``PMI_RANK``, sends its output to ``worker-R.log``, starts the worker command of rank R
(``python -m engine train CONFIG --role worker --rank R --result-file ...``) as its child with its own
environment (``ENGINE_PROGRESS_FILE``...), writes the worker's pid to ``worker-R.pid`` and waits for it.
The worker is the MPI rank (MPI is initialized there, with the PMI connection it inherited), what
the launcher signals and what ``engine.launch.procs.role_pid`` finds by its command line. The shim
records how the worker ended in ``worker-R.exit.json`` and ends the same way. The world file holds
no secret: those travel in mpiexec's environment, which hydra passes to every rank; a rank's shim takes
out the variables its record lists under ``unset`` (the admin token's, on every rank but 0) before it
starts the worker.

``RankProcess`` is what the launcher holds per worker in place of a ``subprocess.Popen``: its ``pid``
is the worker's, signals go to it, and its exit code is read when the world ends. A rank that dies
ends the world (hydra kills the others); the rank that died reports its exit code or signal from its
shim's record, the others report 0, so the launcher's error names the dead worker and the supervisor
restarts the whole job from its newest checkpoint. A rank that fails aborts the world
(``engine.allreduce.end_world``, after logging why): its record, or MPICH's abort line at the end
of its log, names it.

hydra writes a file of the machine's topology for the ranks (``/tmp/hydra_hwloc_xmlfile_*``) and removes
it only when the world ends well. ``World`` removes it after an abort; and since a launcher killed with
SIGKILL can remove nothing, each world holds a directory ``engine-mpi-world-*`` (``engine.scratch``)
that records the file, and the next world started on the machine removes the files that dead
launchers' directories record.
"""
from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..scratch import ScratchDir, sweep_scratch_dirs
from .procs import die_with_parent, parent_pid

log = logging.getLogger(__name__)

WORLD_FILE = "mpi-world.json"
MPIEXEC_LOG = "mpiexec.log"
TOPOLOGY_PREFIX = "hydra_hwloc_xmlfile_"   # hydra's file of the machine's topology for the ranks (in /tmp)
TOPOLOGY_FAST_S = 30.0                     # seconds after the start in which every wake-up looks for it
TOPOLOGY_LOOK_S = 1.0                      # seconds between looks for it after that, until it is found
WORLD_PREFIX = "engine-mpi-world-"          # a world's held directory (engine.scratch), in the temp directory
TOPOLOGY_RECORD = "topology.json"          # in it: the topology file seen, {"path", "dev", "ino"}


def mpiexec_path(python: str = sys.executable) -> str:
    """The ``mpiexec`` beside ``python`` (the mpich wheel installs it into the venv), else on PATH.

    Raises
    ------
    FileNotFoundError
        No mpiexec found (install the hybrid extra: mpi4py and mpich).
    """
    beside = Path(python).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise FileNotFoundError(f"mode hybrid needs mpiexec (MPICH's hydra): none beside {python} or on PATH; "
                            f"pip install mpi4py mpich (make install installs them)")


def world_command(python: str, run_dir: Path, ranks: list[dict]) -> list[str]:
    """Write ``run_dir/mpi-world.json`` and return the mpiexec command that starts the world.

    Parameters
    ----------
    python : str
        Interpreter of the ranks.
    run_dir : Path
    ranks : list of dict
        Per rank r (in order): ``cmd`` (list[str], the worker command), ``env`` (dict[str, str] added to
        the inherited environment), ``unset`` (list[str], optional: variables of the inherited environment
        the worker does not get, e.g. the admin token's on ranks above 0), ``log`` and ``pid`` (paths).
    """
    spec = run_dir / WORLD_FILE
    spec.write_text(json.dumps({"ranks": ranks}))
    # mpiexec dies with the launcher (hydra then ends the proxies and ranks): through this module's
    # --tied-to shim, which sets PR_SET_PDEATHSIG and becomes mpiexec (same pid)
    return [python, "-m", "engine.launch.mpi", "--tied-to", str(os.getpid()), "--",
            mpiexec_path(python), "-launcher", "fork", "-n", str(len(ranks)), python, "-m", "engine.launch.mpi",
            str(spec)]


def main(argv: list[str]) -> None:
    """Per-rank entry under mpiexec: start rank ``PMI_RANK``'s worker and stay its parent (see the module
    docstring and ``_rank_shim``). With ``--tied-to PID -- CMD...`` (the launcher's mpiexec): die when
    PID's starting thread ends, then exec CMD."""
    if len(argv) > 3 and argv[0] == "--tied-to" and argv[2] == "--":
        die_with_parent(int(argv[1]))
        os.execv(argv[3], argv[3:])
    if len(argv) != 1 or "PMI_RANK" not in os.environ:
        sys.exit("usage: mpiexec -n W python -m engine.launch.mpi WORLD.json (started by engine train)")
    rank = int(os.environ["PMI_RANK"])
    _rank_shim(json.loads(Path(argv[0]).read_text())["ranks"][rank])


#: signals hydra or an operator may send a rank's process (hydra's child): passed on to the worker
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _rank_shim(r: dict) -> None:
    """Hydra's child for one rank: fork the worker, wait for it, record how it ended, end the same way.

    The worker (its own process group, its output in ``r["log"]``, its pid in ``r["pid"]``) is what
    the launcher signals and what ``engine.launch.procs.role_pid`` finds. This process stays its
    parent for one reason: to learn how it ended. A rank's end is seen from outside only as "gone",
    and when one rank is killed hydra kills the others with the same signal at once, so two SIGKILLs
    in one wake-up could not be told apart (the launcher named a killed rank 1's peer as the first
    death). ``waitpid`` here gives the worker's own exit code or signal and the time it ended, written
    to ``r["exit"]`` (JSON: ``shim_pid``, ``pid``, ``code`` (negative: a signal), ``ended``, monotonic
    seconds) before this process ends the same way (the same code, or the same signal, so hydra reports
    and cleans up as for the worker itself). The peers hydra then kills end with their shims
    (SIGKILL to the shim, the worker by ``PR_SET_PDEATHSIG``) and record nothing: only a rank that
    ended by itself has a code in its record. ``FORWARDED`` signals are passed on to the worker."""
    fd = os.open(r["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    shim = os.getpid()
    die_with_parent(os.getppid())                  # hydra's proxy: killed, it takes this rank along
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)     # none lost between fork and the handlers
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)                       # a group of its own: the launcher signals it as any child
            die_with_parent(shim)                  # SIGKILL when this shim ends (hydra's cleanup kills it)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            env = {k: v for k, v in os.environ.items() if k not in r.get("unset", ())}
            env.update({**r["env"], "ENGINE_PARENT_PID": str(shim)})
            os.execve(r["cmd"][0], r["cmd"], env)
        except BaseException as e:  # noqa: BLE001 - the forked child must never return into the shim
            os.write(2, f"rank shim: cannot start {r['cmd'][0]}: {e}\n".encode(errors="replace"))
        os._exit(127)
    record = {"shim_pid": shim, "pid": pid}
    Path(r["pid"]).write_text(str(pid))
    _write_record(r["exit"], record)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _forward(pid, s))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    _, status = os.waitpid(pid, 0)                 # retried across the forwarding handlers (PEP 475)
    code = os.waitstatus_to_exitcode(status)
    _write_record(r["exit"], {**record, "code": code, "ended": time.monotonic()})
    if code >= 0:
        os._exit(code)
    signal.signal(-code, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the worker's core (if any) is the one to keep
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
    os.kill(shim, -code)
    os._exit(128 - code)


def _forward(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _write_record(path: str, record: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, path)


def topology_file_of(pid: int) -> tuple[Path, int, int] | None:
    """(path, st_dev, st_ino) of a hydra topology file (``/tmp/hydra_hwloc_xmlfile_*``) that process
    ``pid`` holds open, or None.

    Raises
    ------
    OSError
        ``pid`` is gone, or a descriptor closed meanwhile.
    """
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if os.path.basename(target).startswith(TOPOLOGY_PREFIX):
            st = os.stat(f"/proc/{pid}/fd/{fd}")     # the open file itself
            return Path(target), st.st_dev, st.st_ino
    return None


def remove_topology_file(path, dev: int, ino: int) -> bool:
    """Remove hydra's topology file ``path`` if it is still that very file (device ``dev``, inode
    ``ino``; never through a symbolic link) -> whether it was removed."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
            return True
    except FileNotFoundError:
        pass
    return False


def _undo_world(d: Path) -> None:
    """``on_sweep`` of a dead launcher's world directory: remove the topology file it records.

    Raises
    ------
    OSError, ValueError
        The record cannot be read, or the file removed (``sweep_scratch_dirs`` logs it).
    """
    try:
        rec = json.loads((d / TOPOLOGY_RECORD).read_text())
    except FileNotFoundError:       # the world never got as far as MPI_Init
        return
    try:
        path, dev, ino = str(rec["path"]), int(rec["dev"]), int(rec["ino"])
    except (KeyError, TypeError, ValueError):
        path = ""
    if not (os.path.isabs(path) and os.path.basename(path).startswith(TOPOLOGY_PREFIX)):
        raise ValueError(f"{d / TOPOLOGY_RECORD}: not a record of a hydra topology file: {rec!r}")
    if remove_topology_file(path, dev, ino):
        log.info("removed %s, left by a hybrid launcher that died", path)


def sweep_worlds(root=None) -> list[Path]:
    """Remove the world directories of launchers that died (their lock is free) and the hydra topology
    files they record (``remove_topology_file``); ``World`` does this as it starts. ``root``: where the
    directories are (default ``tempfile.gettempdir()``) -> the directories removed."""
    return sweep_scratch_dirs(root if root is not None else tempfile.gettempdir(), WORLD_PREFIX,
                              on_sweep=_undo_world)


_ABORT = re.compile(r"application called MPI_Abort\(MPI_COMM_WORLD, (\d+)\)")
ABORT_TAIL_BYTES = 64 << 10     # how much of a rank's log end is searched for the abort line


_BAD = re.compile(r"BAD TERMINATION.*?PID (\d+).*?(?:EXIT CODE: (\d+)|KILLED BY SIGNAL: (\d+))", re.S)


class World:
    """One mpiexec running the workers' world; answers for every rank (``RankProcess``).

    Parameters
    ----------
    cmd : list of str
        The mpiexec command (``world_command``).
    env : dict of str -> str
        mpiexec's environment, which hydra passes to every rank.
    run_dir : Path
        Where ``mpiexec.log`` goes.
    pid_paths : list of Path
        Per rank, the file its pid is written to once it started (removed here first).
    rank_logs : list of Path, optional
        Per rank, its log (searched for an ``MPI_Abort`` when the world ends without hydra's report).
    exit_paths : list of Path, optional
        Per rank, its shim's record of how the worker ended (``_rank_shim``; removed here first).
    """

    def __init__(self, cmd: list[str], *, env: dict, run_dir: Path, pid_paths: list[Path],
                 rank_logs: list[Path] | None = None, exit_paths: list[Path] | None = None):
        self.run_dir = run_dir
        self.log_path = run_dir / MPIEXEC_LOG
        self.pid_paths = pid_paths
        self.rank_logs = rank_logs or []
        self.exit_paths = exit_paths or []
        for p in [*pid_paths, *self.exit_paths]:
            p.unlink(missing_ok=True)
        self._scratch_lock = threading.Lock()     # the watch thread records, the launcher's removes
        self.scratch = self._hold()          # before mpiexec: a failed start leaves no unheld record
        try:
            with open(self.log_path, "wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except BaseException:
            self._close_scratch()
            raise
        self._codes: dict[int, int] | None = None
        self.ended_at: dict[int, float] = {}     # rank -> monotonic seconds it was seen to end
        self.topology: tuple[Path, int, int] | None = None   # hydra's file for the ranks, once seen
        threading.Thread(target=self._watch_ends, name="mpi-world-ends", daemon=True).start()

    def _watch_ends(self) -> None:
        """Record when each rank's worker is seen gone (a pidfd per rank, which works for processes that
        are not our children): the order of deaths when no shim recorded one (a shim itself was killed;
        ``_read_codes``). Best effort: where pidfds are missing or refused (a seccomp profile) or two
        ends are seen in one wake-up, the order stays the ranks' own. Also looks for hydra's topology
        file (``_find_topology``) until it is found."""
        import select
        fds: dict[int, int] = {}
        poller = select.poll()
        use_pidfds = hasattr(os, "pidfd_open")
        started = next_look = time.monotonic()
        try:
            while self.proc.poll() is None or fds:
                now = time.monotonic()
                if self.topology is None and now >= next_look:
                    found = self._find_topology()
                    if found is not None:
                        self._record_topology(found)
                    # every wake-up while the world starts (an abort right after MPI_Init would
                    # otherwise beat the look), then once a second
                    next_look = now + (0.0 if now - started < TOPOLOGY_FAST_S else TOPOLOGY_LOOK_S)
                for r in range(len(self.pid_paths)) if use_pidfds else ():
                    if r in fds or r in self.ended_at:
                        continue
                    pid = self.rank_pid(r)
                    if pid is None:
                        continue
                    try:
                        fds[r] = os.pidfd_open(pid)
                        poller.register(fds[r], select.POLLIN)
                    except ProcessLookupError:
                        self.ended_at[r] = time.monotonic()
                    except OSError:             # refused here: the ranks' own order is used
                        use_pidfds = False
                        for fd in fds.values():
                            poller.unregister(fd)
                            os.close(fd)
                        fds.clear()
                        break
                ready = poller.poll(50)
                now = time.monotonic()
                by_fd = {fd: r for r, fd in fds.items()}
                for fd, _ in ready:
                    r = by_fd[fd]
                    self.ended_at.setdefault(r, now)
                    poller.unregister(fd)
                    os.close(fds.pop(r))
                if self.proc.poll() is not None and not ready:
                    break
        finally:
            for fd in fds.values():
                os.close(fd)

    def _find_topology(self) -> tuple[Path, int, int] | None:
        """(path, st_dev, st_ino) of the hwloc topology file (``/tmp/hydra_hwloc_xmlfile_*``) that hydra
        wrote for the ranks once they initialized MPI, found open in the ranks' proxy (a child of this
        mpiexec, the parent of each rank's shim), or None."""
        for r in range(len(self.pid_paths)):
            pid = self.rank_pid(r)
            if pid is None:
                continue
            try:
                proxy = parent_pid(parent_pid(pid))         # worker -> its shim -> hydra's proxy
                if parent_pid(proxy) != self.proc.pid:
                    continue
                found = topology_file_of(proxy)
            except (OSError, ValueError, IndexError):      # not started, or gone meanwhile
                continue
            if found is not None:
                return found
        return None

    def _hold(self) -> ScratchDir | None:
        """This world's directory (``WORLD_PREFIX``), after removing those of dead launchers and the
        topology files they record; None (with a warning) where the temp directory refuses it."""
        try:
            return ScratchDir(WORLD_PREFIX, on_sweep=_undo_world)
        except OSError as e:        # (on_sweep's own errors are logged by the sweep)
            log.warning("no world directory in the temp directory (%s): hydra's topology file will stay "
                        "behind if this launcher is killed with SIGKILL", e)
            return None

    def _record_topology(self, found: tuple[Path, int, int]) -> None:
        """Note ``found`` (path, st_dev, st_ino) as ``topology`` and write it into this world's directory
        (atomically: a sweeper reads a whole record or none), for the next world to remove if this
        launcher dies first. Found after the world ended (its directory closed): removed at once."""
        path, dev, ino = found
        with self._scratch_lock:
            self.topology = found
            if self.scratch is None:
                if self._codes is not None:     # the world ended meanwhile: nobody else will remove it
                    try:
                        remove_topology_file(*found)
                    except OSError:
                        pass
                return
            tmp = self.scratch.path / (TOPOLOGY_RECORD + ".tmp")
            try:
                tmp.write_text(json.dumps({"path": str(path), "dev": dev, "ino": ino}))
                os.replace(tmp, self.scratch.path / TOPOLOGY_RECORD)
            except OSError as e:
                log.warning("could not record hydra's topology file %s in %s: %s", path, self.scratch.path, e)

    def _close_scratch(self) -> None:
        with self._scratch_lock:
            self._drop_scratch()

    def _drop_scratch(self) -> None:
        """Remove this world's directory (the caller holds ``_scratch_lock``)."""
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None

    def _remove_topology(self) -> None:
        """Remove the topology file seen open in this world's proxy, if that very file (same device and
        inode) is still there (mpiexec removes it when the world ends well, not after an abort), then
        this world's directory. Under the lock that ``_record_topology`` takes: a file the watch thread
        finds after this is removed by it."""
        with self._scratch_lock:
            try:
                if self.topology is not None:
                    remove_topology_file(*self.topology)
            except OSError:
                pass
            finally:
                self._drop_scratch()

    def rank_pid(self, rank: int) -> int | None:
        try:
            return int(self.pid_paths[rank].read_text())
        except (OSError, ValueError):
            return None

    def codes(self) -> dict[int, int] | None:
        """Per-rank exit codes (negative: killed by that signal) once mpiexec exited, else None."""
        rc = self.proc.poll()
        if rc is None:
            return None
        if self._codes is None:
            self._codes = self._read_codes(rc)
            # an mpiexec that ended the world for an MPI_Abort (a failed rank: engine.modes.hybrid
            # .end_world) leaves its topology file behind, one per restart
            self._remove_topology()
        return self._codes

    def exit_record(self, rank: int) -> dict | None:
        """The record ``rank``'s shim wrote (``_rank_shim``): ``shim_pid`` and ``pid`` once the worker
        started, and once it ended by itself ``code`` and ``ended``; None if none (yet) or unreadable."""
        try:
            rec = json.loads(self.exit_paths[rank].read_text())
        except (IndexError, OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def end_time(self, rank: int) -> float | None:
        """Monotonic seconds ``rank``'s worker ended: its shim's record (exact), else when
        ``_watch_ends`` saw it gone, else None."""
        rec = self.exit_record(rank)
        if rec is not None and isinstance(rec.get("ended"), (int, float)):
            return float(rec["ended"])
        return self.ended_at.get(rank)

    def _read_codes(self, rc: int) -> dict[int, int]:
        n = len(self.pid_paths)
        if rc == 0:
            return dict.fromkeys(range(n), 0)
        records = {r: self.exit_record(r) or {} for r in range(n)}
        ended = {r: rec["code"] for r, rec in records.items() if isinstance(rec.get("code"), int)}
        if any(ended.values()):
            # the shims' records: each rank that ended by itself, with its own code or signal; the
            # peers hydra killed after it recorded nothing and report 0
            return {r: ended.get(r, 0) for r in range(n)}
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        pids = {self.rank_pid(r): r for r in range(n)}
        pids.update({rec.get("shim_pid"): r for r, rec in records.items()})   # hydra names its children
        codes = dict.fromkeys(range(n), 0)
        named = False
        for m in _BAD.finditer(text):
            rank = pids.get(int(m.group(1)))
            if rank is None:
                continue
            code = -int(m.group(3)) if m.group(3) else int(m.group(2))
            if code > 0 and f"(signal {code})" in text:   # hydra prints a killed rank as EXIT CODE: SIGNUM
                code = -code
            codes[rank], named = code, True
        if not named:
            aborted = self._aborted()
            if aborted is not None:     # a rank called MPI_Abort (end_world): hydra reports nothing
                rank, code = aborted
                return {**dict.fromkeys(range(n), 0), rank: code}
            # mpiexec itself failed or was killed: every rank shares its exit
            codes = dict.fromkeys(range(n), rc if rc > 0 else rc or 1)
        first = self._first_ended()
        bad = next((c for c in codes.values() if c != 0), None)
        if first is not None and bad is not None and codes[first] == 0:
            # no shim recorded an end (a shim itself was killed): hydra reports the lowest rank it
            # found failed, not the first to fail, so the rank seen to end first takes the code
            codes[first] = bad
        return codes

    def _aborted(self) -> tuple[int, int] | None:
        """(rank, code) of the lowest rank that started in this world (its pid file, written after its
        log was truncated) and whose log's last ``ABORT_TAIL_BYTES`` hold MPICH's line for an
        ``MPI_Abort`` of the world (right after ``end_world``'s, which gives the reason), or None."""
        for r, path in enumerate(self.rank_logs):
            if self.rank_pid(r) is None:        # not started in this world: its log may be an older one
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - ABORT_TAIL_BYTES))
                    tail = f.read().decode(errors="replace")
            except OSError:
                continue
            m = _ABORT.search(tail)
            if m:
                return r, int(m.group(1)) or 1
        return None

    def _first_ended(self) -> int | None:
        """The rank that ended strictly before every other (``end_time``), or None."""
        times = sorted((t, r) for r in range(len(self.pid_paths)) if (t := self.end_time(r)) is not None)
        if not times or (len(times) > 1 and times[1][0] <= times[0][0]):
            return None
        return times[0][1]

    def signal_all(self, sig: int) -> None:
        """``sig`` to mpiexec's process group (mpiexec, hydra's proxy and every rank)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, n: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class RankProcess:
    """The ``subprocess.Popen`` subset the launcher uses (pid, poll, wait, send_signal) for one rank of
    a ``World``. ``pid`` is the rank's own process once it started (mpiexec's until then)."""

    def __init__(self, world: World, rank: int):
        self.world, self.rank = world, rank

    @property
    def pid(self) -> int:
        return self.world.rank_pid(self.rank) or self.world.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    @property
    def ended_at(self) -> float | None:
        """Monotonic seconds this rank's worker ended (``World.end_time``), or None."""
        return self.world.end_time(self.rank)

    def poll(self) -> int | None:
        """This rank's exit code (negative: a signal) once the world ended; before that, the code of a
        worker that failed by itself (its shim's record), so the launcher acts on it at once: hydra does
        not end a world whose rank exits before ``MPI_Init`` (its peers wait there), the launcher does."""
        codes = self.world.codes()
        if codes is None:
            code = (self.world.exit_record(self.rank) or {}).get("code")
            return code if isinstance(code, int) and code != 0 else None
        return codes[self.rank]

    def wait(self, timeout: float | None = None) -> int:
        self.world.proc.wait(timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        """``sig`` to this rank only (a SIGTERM preempts it: it checkpoints at its next meeting)."""
        pid = self.world.rank_pid(self.rank)
        if pid is None or self.world.proc.poll() is not None:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


#: The local launcher's world runs on one host, so its ranks need no interface but loopback. MPICH's
#: ch4 netmod opens listeners for its peers on every interface it finds: with the mpich 5.0 wheel (UCX),
#: each rank listened on the machine's network address too (2026-11-30: ``ss -ltnp`` under a world of
#: 2 ranks), open to anyone who reaches the host, for traffic that is neither authenticated nor
#: encrypted. ``UCX_NET_DEVICES=lo`` alone confined them to 127.0.0.1 (measured; ``-iface lo`` and
#: ``FI_TCP_IFACE=lo`` did not); ``FI_TCP_IFACE`` does the same for a build on libfabric's tcp provider.
#: Hydra's own control port between mpiexec and its proxy binds every interface whatever is set (its
#: design); README "Hybrid mode" says so. A value the user set is kept, with a warning.
LOOPBACK_ONLY = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo"}


def loopback_env(env: dict) -> dict:
    """``env`` (mpiexec's environment, which hydra passes to every rank) with ``LOOPBACK_ONLY`` added;
    a variable ``env`` already sets to something else is kept, and logged as a warning."""
    out = dict(env)
    for k, v in LOOPBACK_ONLY.items():
        if out.get(k, v) != v:
            log.warning("hybrid: %s=%s is set: the MPI ranks may listen on that interface, not only on "
                        "loopback (unauthenticated, unencrypted traffic)", k, out[k])
        out.setdefault(k, v)
    return out


def rank_records(cluster) -> list[dict]:
    """Per worker rank of ``cluster`` (a ``LocalCluster``): the record its shim reads from the world file
    (``world_command``'s ``ranks``; ``result`` added: the worker's result file). Each worker's old
    result and progress files are removed (``LocalCluster.worker_files``)."""
    from .. import progress

    run_dir = cluster.run_dir
    ranks = []
    for r in range(cluster.cfg.cluster.workers):
        result, prog = cluster.worker_files(r)
        ranks.append({"cmd": cluster.role_command("worker", r, ["--result-file", str(result)]),
                      "env": {**cluster.role_env("worker", r), progress.ENV: str(prog)},
                      "unset": list(cluster.withheld_env("worker", r)),
                      "log": str(run_dir / f"worker-{r}.log"), "pid": str(run_dir / f"worker-{r}.pid"),
                      "exit": str(run_dir / f"worker-{r}.exit.json"), "result": str(result)})
    return ranks


def start_world(cluster, env: dict, *, child) -> list:
    """Start ``cluster``'s (a ``LocalCluster``) workers as one MPI world -> their ``child`` objects
    (``engine.launch.local.Child``, passed in so this module never imports the launcher), with the
    command, environment, log, result and progress files ``LocalCluster`` gives any worker; the ranks
    listen on loopback only (``loopback_env``).

    Raises
    ------
    FileNotFoundError
        No mpiexec (see ``mpiexec_path``).
    """
    from .. import progress

    run_dir = cluster.run_dir
    ranks = rank_records(cluster)
    children = [(r, Path(x["result"]), Path(x["env"][progress.ENV])) for r, x in enumerate(ranks)]
    world = World(world_command(cluster.python, run_dir, ranks), env=loopback_env(cluster.child_env(env)),
                  run_dir=run_dir, pid_paths=[Path(x["pid"]) for x in ranks],
                  rank_logs=[Path(x["log"]) for x in ranks], exit_paths=[Path(x["exit"]) for x in ranks])
    out = []
    for r, result, prog in children:
        c = child("worker", r, RankProcess(world, r), Path(ranks[r]["log"]))
        c.result_path, c.progress_path = result, prog
        out.append(c)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
