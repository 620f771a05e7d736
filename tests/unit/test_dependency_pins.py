"""``constraints.txt`` pins what ``make install`` installs: every dependency of the package and of its
extras (as installed from ``pyproject.toml``) has a pin for this Python within its declared range, and this
environment holds exactly the pinned versions (the suite runs on what the file says; an install made without
the file, or a file edited without a reinstall, fails here by name)."""
from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    """``{canonical name: version}`` of the lines of constraints.txt that apply to this interpreter."""
    out = {}
    for n, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        (spec,) = req.specifier                     # exactly one "==" per package
        assert spec.operator == "==", f"constraints.txt line {n}: {line!r} is no pin"
        assert canonicalize_name(req.name) not in out, f"constraints.txt line {n}: {req.name} pinned twice"
        out[canonicalize_name(req.name)] = spec.version
    return out


def declared() -> list[Requirement]:
    """The package's requirements and those of every extra, for this interpreter (the installed metadata of
    pyproject.toml: ``make install`` reinstalls when either file changes)."""
    dist = "sparse-engine"
    extras = md.metadata(dist).get_all("Provides-Extra") or []
    out = []
    for req in map(Requirement, md.requires(dist) or []):
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ["", *extras]):
            out.append(req)
    return out


def test_every_declared_dependency_is_pinned_within_its_range():
    p = pins()
    reqs = declared()
    assert len(reqs) > 20, reqs                    # the package's own and its extras' (32 on 2026-11-30)
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in p, f"{req.name} (pyproject.toml) has no pin in constraints.txt: run `make lock`"
        assert req.specifier.contains(p[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={p[name]} outside pyproject.toml's {req.specifier}: run `make lock`"


def test_this_environment_holds_the_pinned_versions():
    wrong = []
    for name, version in sorted(pins().items()):
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            wrong.append(f"{name}: not installed (pinned {version})")
            continue
        if Version(have) != Version(version):
            wrong.append(f"{name}: {have} installed, {version} pinned")
    if wrong:
        pytest.fail("the environment differs from constraints.txt (run `make install`): " + "; ".join(wrong))
