"""A Ray actor of the launcher's seen as a child process (``engine.launch.ray``): ``poll``, ``wait`` and
``send_signal`` over actor calls, each bounded in time, with what Ray says when an actor dies or does not
answer (its node lost, the actor or its node stalled).

A call left unanswered marks the actor stalled and its node silent (``silent_nodes``, shared by the
actors of one attempt): later calls to actors there wait ``STALLED_TIMEOUT_S`` at most, and no new call
is made to a stalled actor until its unanswered one ends, so a frozen node costs one ``CALL_TIMEOUT_S``.
"""
from __future__ import annotations

import logging
import socket
import subprocess
import time

from .ray_nodes import death_cause

log = logging.getLogger("engine.launch.ray")

#: a role's exit code when its actor died (the actor's process was killed): like SIGKILL
ACTOR_DIED = -9
#: seconds any call to an actor may take (they only read small files or send signals)
CALL_TIMEOUT_S = 30.0
#: seconds a call may take to an actor whose node is silent (another actor there left a call unanswered), or
#: whose own unanswered call just ended (``_ActorProc._get``)
STALLED_TIMEOUT_S = 1.0
#: seconds a look at an unreachable actor's raylet may take (a refused connection: the node is lost)
RAYLET_PROBE_S = 1.0


class _ActorProc:
    """The part of ``subprocess.Popen`` the launcher uses, through a ``RoleActor``; a dead actor reads
    as a child killed by SIGKILL (``ACTOR_DIED``), unless its role's own exit code was known before.
    ``actor_dead`` tells a dead actor from a role killed by SIGKILL under a live one (both exit -9)."""

    def __init__(self, ray, actor, pid: int, node: tuple[str, str, int] | None = None,
                 silent_nodes: dict | None = None):
        self._ray, self._actor, self.pid = ray, actor, pid
        self.node = node            # (node id, address, raylet port) of the actor's node
        self._code: int | None = None
        self.stalled = False        # a call timed out: no new one is made until that one ends
        self.stalled_since: float | None = None     # monotonic time its first unanswered call was made
        self._pending = None        # the ref of its unanswered call, while it is stalled
        # node id -> monotonic time a call to an actor there was first left unanswered, shared by the
        # actors of one attempt (``RayCluster``): a frozen node holds every actor on it
        self.silent_nodes = {} if silent_nodes is None else silent_nodes
        self.actor_dead = False     # a call found the actor dead, or the launcher killed it (shutdown)
        self.death: str | None = None   # why Ray says it died (``death_cause``): its node lost, or its own

    def _get(self, call, timeout: float = CALL_TIMEOUT_S, on_timeout=None, queue: bool = False):
        """The answer of the call ``call()`` makes (it returns the ref); ``ACTOR_DIED`` when its actor died;
        ``on_timeout`` when it did not answer within ``timeout`` seconds: the actor is stalled, and no new
        call is made (each returns ``on_timeout`` at once) until that one ends. A call to an actor whose
        node is silent (``silent_nodes``) waits ``STALLED_TIMEOUT_S`` at most: a frozen node costs one
        ``CALL_TIMEOUT_S``. Before, each actor of a frozen node took 30 s in turn, then every poll, read,
        tail and teardown step 1 s.

        An actor Ray finds unreachable (``ActorUnavailableError``: a connection reset or refused) is dead
        when its node's raylet refuses connections too (the node was lost), else it is stalled: Ray says
        it died once its health checks find the node dead, or the role's beat ages. Before, any such error
        was a death, so one reset connection to a live actor restarted the job. ``queue``: a call made all
        the same while the actor is stalled, unwaited (a signal: it is delivered if the actor resumes)."""
        if self._pending is not None:
            if not self._ray.wait([self._pending], timeout=0)[0]:
                if queue:
                    call()
                return on_timeout               # still unanswered: no read piles up behind it
            self._pending = None                # it ended: the call below tells how
        ref = call()
        unavailable = getattr(self._ray.exceptions, "ActorUnavailableError", ())
        node_id = self.node[0] if self.node else None
        silent = self.stalled or node_id in self.silent_nodes
        called = time.monotonic()
        try:
            value = self._ray.get(ref, timeout=min(timeout, STALLED_TIMEOUT_S) if silent else timeout)
        except self._ray.exceptions.RayActorError as e:
            lost = self.node_lost()
            if isinstance(e, unavailable) and lost is None:
                if not self.stalled:
                    log.warning("the Ray actor of pid %d is unreachable (%s); its node's raylet answers: waiting for "
                                "it to answer again, or for Ray to find it dead", self.pid,
                                (str(e).splitlines() or [""])[0][:300])
                self._silent(called)
                return on_timeout
            self.actor_dead = True
            if self.death is None:
                self.death = death_cause(e, self.node, lost)
            if self._code is None:
                self._code = ACTOR_DIED
            return ACTOR_DIED
        except self._ray.exceptions.GetTimeoutError:
            if not self.stalled:
                where = f" on node {self.node[0][:12]} ({self.node[1]})" if self.node else ""
                log.warning("the Ray actor of pid %d%s answered no call within %.0f s: it or its node is stalled",
                            self.pid, where, time.monotonic() - called)
            self._silent(called)
            self._pending = ref
            return on_timeout
        self.stalled, self.stalled_since = False, None
        if node_id is not None:
            self.silent_nodes.pop(node_id, None)       # its node answers
        return value

    def _silent(self, called: float) -> None:
        """A call made at ``called`` (monotonic) was left unanswered: the actor is stalled, and so, until
        one of its actors answers, is its node."""
        self.stalled = True
        if self.stalled_since is None:
            self.stalled_since = called
        if self.node is not None:
            self.silent_nodes.setdefault(self.node[0], called)

    def node_lost(self) -> str | None:
        """Why this actor's node is known lost (its raylet refuses TCP connections: the raylet died, with
        every actor of the node), or None (it answers, or cannot be reached in ``RAYLET_PROBE_S``: a
        stalled or unreachable node, not known lost)."""
        if self.node is None or not self.node[2]:
            return None
        _, ip, port = self.node
        try:
            socket.create_connection((ip, port), timeout=RAYLET_PROBE_S).close()
        except ConnectionRefusedError:
            return f"its raylet at {ip}:{port} refuses connections"
        except OSError:
            pass
        return None

    def poll(self) -> int | None:
        if self._code is None and self.actor_dead:
            self._code = ACTOR_DIED
        if self._code is None:
            code = self._get(self._actor.poll.remote)
            if code is not None:
                self._code = code
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:
            code = self._get(lambda: self._actor.wait.remote(timeout if timeout is not None else 3600.0),
                             (timeout or 3600.0) + CALL_TIMEOUT_S)
            if code is None:
                raise subprocess.TimeoutExpired(f"actor child {self.pid}", timeout)
            self._code = code
        return self._code

    def send_signal(self, sig: int) -> None:
        if self._code is None and not self.actor_dead:
            self._get(lambda: self._actor.signal.remote(sig, False), queue=True)
