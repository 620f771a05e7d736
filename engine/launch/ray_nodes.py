"""What the Ray launcher (``engine.launch.ray``) checks of a Ray cluster and its nodes: resources that make
valid bundles, the checkpoint rule of several nodes, which role's resources no live node offers (a lost node
not replaced: ``unoffered``), and how a role whose actor died ended (its node lost or its own process:
``death_cause``). Plain functions over configs, Ray's node records and Ray's error messages; no Ray import.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..errors import ConfigError

#: Ray's finest resource unit: a non-zero quantity below it is refused by Ray
RESOURCE_UNIT = 0.0001
#: the fields of Ray's ``ActorDiedError`` message that are not its cause
_DIED_FIELDS = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")


def death_cause(error, node: tuple[str, str, int] | tuple[str, str] | None, lost: str | None = None) -> str:
    """How a role whose actor died ended, for the failure's line, from Ray's ``error`` (its message): "died
    with its Ray node ID (ADDRESS), which was lost: WHY" when its node died (Ray's reason, or ``lost``:
    what ``_ActorProc.node_lost`` found), else "its Ray actor died: CAUSE" (Ray's first line of cause)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    where = f"{node[0][:12]} ({node[1]})" if node else "(unknown)"
    for i, ln in enumerate(lines):
        if "its node has died" in ln:
            rest = [x for x in lines[i + 1:] if not x.startswith(_DIED_FIELDS)]
            return f"died with its Ray node {where}, which was lost: {(rest or [ln])[0][:300]}"
    if lost:
        return f"died with its Ray node {where}, which was lost: {lost}"
    causes = [ln for ln in lines[1:] if not ln.startswith(_DIED_FIELDS)] or lines or [type(error).__name__]
    return f"its Ray actor died: {causes[0][:300]}"


def check_resources(cfg: EngineConfig) -> None:
    """``cluster.server_resources`` and ``worker_resources`` make valid Ray bundles: at least one value
    above 0 (Ray refuses a bundle of zeros), and none between 0 and Ray's unit ``RESOURCE_UNIT``.

    Raises
    ------
    ConfigError
        Naming the key and the value.
    """
    for key in ("server_resources", "worker_resources"):
        resources = getattr(cfg.cluster, key)
        if not resources:
            continue                    # the default, a token {CPU: 0.01}
        if not any(v > 0 for v in resources.values()):
            raise ConfigError(f"cluster.{key}={dict(resources)}: a Ray bundle needs at least one resource above 0 "
                              f"(e.g. {{CPU: 0.01}}, the default when it is empty)")
        fine = [k for k, v in resources.items() if 0 < v < RESOURCE_UNIT]
        if fine:
            raise ConfigError(f"cluster.{key}={dict(resources)}: {fine[0]} is below Ray's smallest quantity "
                              f"{RESOURCE_UNIT:g} (use 0, or at least {RESOURCE_UNIT:g})")


def unoffered(needs: list[tuple[str, int, dict]], nodes: list[dict]) -> list[str]:
    """For each role whose bundle no live node can hold, a phrase naming the role, its ranks and the
    resources no node offers (in that quantity), e.g. "no live Ray node offers worker_node: 1 for worker
    0-1 (cluster.worker_resources={'worker_node': 1})".

    Parameters
    ----------
    needs : list of (role, count, resources)
        Each role's bundle (resource name -> quantity per role process); a count of 0 is skipped.
    nodes : list of dict
        ``ray.nodes()`` entries of the live nodes (their ``Resources``: totals).
    """
    out = []
    for role, count, res in needs:
        totals = [n.get("Resources") or {} for n in nodes]
        if not count or any(all(t.get(k, 0.0) >= v for k, v in res.items()) for t in totals):
            continue
        most = {k: max([t.get(k, 0.0) for t in totals] + [0.0]) for k in res}
        short = [f"{k}: {v:g}" + (f" (the most a node offers: {most[k]:g})" if most[k] else "")
                 for k, v in res.items() if most[k] < v]
        what = ", ".join(short) if short else f"all of {res} on one node"
        ranks = f"{role} 0" if count == 1 else f"{role} 0-{count - 1}"
        out.append(f"no live Ray node offers {what} for {ranks} (cluster.{role}_resources={res})")
    return out


def check_shared_checkpoints(cfg: EngineConfig, nodes: int) -> None:
    """With more than one node, a local ``checkpoint.root`` needs ``checkpoint.shared: true``.

    Raises
    ------
    ConfigError
        Naming ``checkpoint.root`` and ``checkpoint.shared``.
    """
    root = cfg.checkpoint.root
    local = bool(root) and ("://" not in root or root.startswith("file://"))
    if nodes > 1 and local and not cfg.checkpoint.shared:
        raise ConfigError(f"checkpoint.root {root!r} is a local path, but the Ray cluster has {nodes} nodes: "
                          f"servers on different nodes would write their parts to different disks. Use shared "
                          f"storage (s3://, hdfs://), or a path every node mounts declared with "
                          f"checkpoint.shared: true")
