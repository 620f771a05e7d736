"""A Ray node that answers no call (``engine.launch.ray``): a machine that vanished, hung or was cut off
without closing its connections, every process on it frozen. Nothing refuses a connection (its raylet's
port may even accept TCP connections, as a stopped process's socket does), so the launcher sees only
calls to its actors that time out, and Ray finds the node dead only when its health checks fail (by
default about 65 s after the node stopped: 5 failed checks, each 10 s plus 3 s apart).

- ``silent_cause``: what a role found hung says of its node when its actor answers no call: the node
  Ray found dead, the node silent (every actor of the job on it silent), or the actor alone.
- ``remember`` / ``wait_silent_nodes``: an attempt that ended with a silent node records it; the next
  attempt places its roles only once Ray lists that node dead, or it answers a probe task again. A
  placement group Ray began to place on a frozen node it still listed alive never completed (Ray 2.60:
  its bundles on the other nodes stayed reserved, and the job exited 69 saying the resources were "not
  free for every role"), even after the node was found dead and a replacement had joined.
"""
from __future__ import annotations

import logging
import time

from ..errors import PlacementError, StoppedWhilePlacing
from .ray_nodes import death_cause

log = logging.getLogger(__name__)

#: node id -> (address, monotonic time its actors stopped answering) of the nodes an ended attempt of this
#: driver found silent, until Ray lists them dead or they answer again (one driver runs one job)
SILENT_NODES: dict[str, tuple[str, float]] = {}
#: seconds between two looks at Ray's node table while a silent node is waited for
LOOK_S = 0.5


def silent_cause(ray, node: tuple[str, str], silent_s: float, mates: list[str], all_silent: bool) -> str:
    """Why a role whose actor has answered no call for ``silent_s`` seconds hangs, naming its Ray ``node``
    (id, address): lost, once Ray lists it dead (``ray.nodes()``; unread when the GCS fails); else silent
    with every actor of the job's roles on it (``mates``, ``all_silent``: a frozen or unreachable node), or
    the actor alone silent (its process frozen)."""
    where = f"Ray node {node[0][:12]} ({node[1]})"
    try:
        record = next((n for n in ray.nodes() if n.get("NodeID") == node[0]), None)
    except Exception:  # noqa: BLE001 - the GCS did not answer: what the actors said stands
        record = None
    if record is not None and not record.get("Alive", True):
        return death_cause("", node, lost=record.get("DeathReasonMessage") or "Ray's health checks found it dead")
    if all_silent:
        return (f"its {where} answers no call for {silent_s:.0f} s, nor does any actor of the job on it "
                f"({', '.join(mates)}): the node is frozen or unreachable (Ray lists it alive until its health "
                f"checks fail)")
    return (f"its Ray actor answers no call for {silent_s:.0f} s, while the job's other actors on its {where} "
            f"answer: the actor's process is frozen")


def remember(node_id: str, address: str, since: float) -> None:
    """Record a node every actor of an ended attempt on it left unanswered since ``since`` (monotonic)."""
    SILENT_NODES.setdefault(node_id, (address, since))


def _probe(ray, node_id: str):
    """A task (no CPU) pinned to ``node_id``, whose answer says the node runs tasks again."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def answer() -> bool:
        return True
    return ray.remote(answer).options(
        num_cpus=0, max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


def wait_silent_nodes(ray, deadline: float, stopping, timeout_s: float) -> None:
    """Return once every node of ``SILENT_NODES`` is listed dead by Ray (its health checks) or answered a
    probe task (it was only slow), forgetting each; checked every ``LOOK_S`` until ``deadline``
    (monotonic; the end of the placement's ``cluster.startup_timeout_s``, ``timeout_s``).

    Raises
    ------
    PlacementError
        A silent node still listed alive, unanswering, at ``deadline``: one line naming it.
    StoppedWhilePlacing
        ``stopping()`` became true (the driver was preempted) meanwhile.
    """
    probes: dict[str, object] = {}
    said = False
    while SILENT_NODES:
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
        for node_id, (address, since) in list(SILENT_NODES.items()):
            if node_id not in alive:
                log.info("Ray node %s (%s), silent since %.0f s ago, is listed dead: placing the roles", node_id[:12],
                         address, time.monotonic() - since)
                del SILENT_NODES[node_id]
                continue
            if node_id not in probes:
                probes[node_id] = _probe(ray, node_id)
            done, _ = ray.wait([probes[node_id]], timeout=0)
            if done:
                try:
                    ray.get(done[0], timeout=1.0)
                    log.info("Ray node %s (%s) answers again: placing the roles", node_id[:12], address)
                except Exception:  # noqa: BLE001 - it failed there: the node is going; the table will say so
                    del probes[node_id]
                    continue
                del SILENT_NODES[node_id]
        if not SILENT_NODES:
            return
        if stopping():
            raise StoppedWhilePlacing("preempted while waiting for Ray to find a silent node dead")
        names = ", ".join(f"{n[:12]} ({a}, silent for {time.monotonic() - s:.0f} s)"
                          for n, (a, s) in SILENT_NODES.items())
        if time.monotonic() >= deadline:
            raise PlacementError(f"Ray still lists node {names} alive, though it answers no call, after "
                                 f"cluster.startup_timeout_s={timeout_s:g}s: the roles were not placed (a placement "
                                 f"on a frozen node never completes)", reason="placement", exit_code=None)
        if not said:
            log.warning("waiting up to %.0f s (cluster.startup_timeout_s) for Ray to find node %s dead, or for it to "
                        "answer, before placing the roles", deadline - time.monotonic(), names)
            said = True
        time.sleep(LOOK_S)
