"""What the Ray launcher says of a lost node (``engine.launch.ray_nodes``, ``engine.launch.ray_actors._ActorProc``),
without a Ray cluster: which role's resources no live node offers, how a role whose actor died ended (Ray's
own error messages, as a 2-node test cluster gave them when a node was removed), and the raylet probe that
tells a lost node from an unreachable actor (real sockets on 127.0.0.1). The whole path, on real Ray nodes,
is tests/integration/test_ray_node_loss.py (make test-long)."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from ray.core.generated.common_pb2 import ActorDiedErrorContext  # noqa: E402

from engine.launch.ray_actors import ACTOR_DIED, _ActorProc  # noqa: E402
from engine.launch.ray_nodes import death_cause, unoffered  # noqa: E402
from engine.launch.ray_silent import silent_cause  # noqa: E402

PS, WORKER = {"ps_node": 1.0}, {"worker_node": 1.0}
NEEDS = [("server", 2, PS), ("worker", 2, WORKER)]
#: Ray 2.60's cause when the GCS found an actor's node dead (its health checks)
NODE_DIED = ("The actor died because its node has died. Node Id: 5e7293b7859774fbcd\n\tthe actor's node was "
             "terminated unexpectedly: health check failed due to missing too many heartbeats")


def node(**resources) -> dict:
    return {"NodeID": "n", "Alive": True, "Resources": {"CPU": 1.0, **resources}}


def test_unoffered_names_each_role_whose_resources_no_live_node_offers():
    assert unoffered(NEEDS, [node(ps_node=4), node(worker_node=4)]) == []
    assert unoffered(NEEDS, [node(ps_node=4)]) == [
        "no live Ray node offers worker_node: 1 for worker 0-1 (cluster.worker_resources={'worker_node': 1.0})"]
    both = unoffered(NEEDS, [])
    assert len(both) == 2 and "ps_node: 1 for server 0-1" in both[0] and "worker_node: 1 for worker 0-1" in both[1]
    # a node offers less than one role needs
    assert unoffered([("worker", 1, {"worker_node": 2.0})], [node(worker_node=1)]) == [
        "no live Ray node offers worker_node: 2 (the most a node offers: 1) for worker 0 "
        "(cluster.worker_resources={'worker_node': 2.0})"]
    # every resource exists, but never together on one node
    split = unoffered([("server", 1, {"ps_node": 1.0, "ssd": 1.0})], [node(ps_node=1), node(ssd=1)])
    assert len(split) == 1 and "all of {'ps_node': 1.0, 'ssd': 1.0} on one node for server 0" in split[0]
    assert unoffered([("worker", 0, WORKER)], []) == []        # no workers: nothing to place


def test_death_cause_names_the_lost_node_from_rays_message_or_the_probe():
    where = ("5e7293b78597d1c3", "192.0.2.7", 40000)
    died = ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        class_name="RoleActor", actor_id=b"\x01" * 16, pid=42, node_ip_address="192.0.2.7", error_message=NODE_DIED))
    assert death_cause(died, where) == ("died with its Ray node 5e7293b78597 (192.0.2.7), which was lost: the actor's "
                                        "node was terminated unexpectedly: health check failed due to missing too "
                                        "many heartbeats")
    reset = ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: RpcError: recvmsg:Connection "
                                                 "reset by peer", b"\x01" * 16)
    assert death_cause(reset, where, "its raylet at 192.0.2.7:40000 refuses connections") == (
        "died with its Ray node 5e7293b78597 (192.0.2.7), which was lost: its raylet at 192.0.2.7:40000 refuses "
        "connections")
    own = ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        class_name="RoleActor", actor_id=b"\x01" * 16, pid=42, node_ip_address="192.0.2.7",
        error_message="The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"))
    assert death_cause(own, where) == ("its Ray actor died: The actor is dead because its worker process has died. "
                                       "Worker exit type: SYSTEM_ERROR")


#: an actor handle for ``_ActorProc``: its ``poll`` call is made (the answer comes from ``_Ray.get``)
_ACTOR = SimpleNamespace(poll=SimpleNamespace(remote=lambda: None))


class _Ray:
    """``ray`` for ``_ActorProc``: Ray's exception classes; ``get`` raises ``error`` (a real call to an actor
    cannot be made to fail this way on purpose)."""

    exceptions = ray.exceptions

    def __init__(self, error: Exception):
        self.error = error

    def get(self, ref, timeout=None):
        raise self.error


def test_an_unreachable_actor_is_dead_only_when_its_raylet_refuses_connections():
    reset = ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: RpcError: recvmsg:Connection "
                                                 "reset by peer", b"\x01" * 16)
    with socket.create_server(("127.0.0.1", 0)) as raylet:      # its node's raylet answers: not known lost
        port = raylet.getsockname()[1]
        proc = _ActorProc(_Ray(reset), _ACTOR, 7, ("5e7293b78597d1c3", "127.0.0.1", port))
        assert proc.node_lost() is None
        assert proc._get(lambda: None, on_timeout="no answer") == "no answer"
        assert proc.stalled and not proc.actor_dead and proc.poll() is None
    # the port is closed now: the raylet died, with every actor of its node
    proc = _ActorProc(_Ray(reset), _ACTOR, 7, ("5e7293b78597d1c3", "127.0.0.1", port))
    assert proc.node_lost() == f"its raylet at 127.0.0.1:{port} refuses connections"
    assert proc.poll() == ACTOR_DIED and proc.actor_dead
    assert proc.death == (f"died with its Ray node 5e7293b78597 (127.0.0.1), which was lost: its raylet at "
                          f"127.0.0.1:{port} refuses connections")


def test_a_silent_actor_names_its_node_and_whether_the_node_or_the_actor_alone_is_silent():
    node = ("5e7293b78597d1c3aa", "192.0.2.7")
    listed = SimpleNamespace(nodes=lambda: [{"NodeID": node[0], "Alive": True}])
    assert silent_cause(listed, node, 31.4, ["worker 0", "worker 1"], True) == (
        "its Ray node 5e7293b78597 (192.0.2.7) answers no call for 31 s, nor does any actor of the job on it "
        "(worker 0, worker 1): the node is frozen or unreachable (Ray lists it alive until its health checks fail)")
    assert silent_cause(listed, node, 8, ["worker 0", "worker 1"], False) == (
        "its Ray actor answers no call for 8 s, while the job's other actors on its Ray node 5e7293b78597 "
        "(192.0.2.7) answer: the actor's process is frozen")
    dead = SimpleNamespace(nodes=lambda: [{"NodeID": node[0], "Alive": False, "DeathReasonMessage":
                                           "health check failed due to missing too many heartbeats"}])
    assert silent_cause(dead, node, 70, ["server 0"], True) == (
        "died with its Ray node 5e7293b78597 (192.0.2.7), which was lost: health check failed due to missing too "
        "many heartbeats")

    def down():
        raise ConnectionError("GCS unreachable")
    assert "answers no call for 40 s" in silent_cause(SimpleNamespace(nodes=down), node, 40, ["server 0"], True)
