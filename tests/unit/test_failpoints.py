"""Failpoints (``engine.failpoints``): ``sleep:S`` at every hit, ``sleep:S@N`` at the N-th hit only (a
chaos test's hang at a chosen step), several per point; a malformed value is refused naming the pair."""
from __future__ import annotations

import pytest

from engine import failpoints


def test_parse_every_hit_and_one_hit():
    assert failpoints._parse("a=sleep:1.5; b=sleep:0.05,sleep:600@40") == {
        "a": [(1.5, None)], "b": [(0.05, None), (600.0, 40)]}
    assert failpoints._parse("") == {}


@pytest.mark.parametrize("text", ["a=hang:1", "=sleep:1", "a=sleep:x", "a=sleep:1@x", "a=sleep:1@0",
                                  "a=sleep:1,kill:9"])
def test_a_malformed_value_is_refused_naming_the_pair(text):
    with pytest.raises(ValueError, match=failpoints.ENV) as e:
        failpoints._parse(text)
    assert repr(text.partition(";")[0]) in str(e.value) or text in str(e.value)


def test_an_at_n_action_sleeps_at_that_hit_only(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    monkeypatch.setattr(failpoints, "_points", failpoints._parse("p=sleep:0.01,sleep:7@3;q=sleep:2@1"))
    monkeypatch.setattr(failpoints, "_hits", {})
    for _ in range(5):
        failpoints.hit("p")
    failpoints.hit("other")                       # not configured: nothing, not counted
    assert slept == [0.01, 0.01, 0.01, 7.0, 0.01, 0.01]
    failpoints.hit("q")
    failpoints.hit("q")
    assert slept[-1] == 2.0 and len(slept) == 7   # q's first hit only
    assert failpoints._hits == {"p": 5, "q": 2}


def test_no_point_acts_or_counts_while_suspended(monkeypatch):
    """The warm-up's requests (``failpoints.suspended``) neither sleep nor use up a ``@N`` hit."""
    slept = []
    monkeypatch.setattr(failpoints, "_points", failpoints._parse("p=sleep:7@2"))
    monkeypatch.setattr(failpoints, "_hits", {})
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    with failpoints.suspended():
        for _ in range(3):
            failpoints.hit("p")
    assert slept == [] and failpoints._hits == {}
    failpoints.hit("p")
    failpoints.hit("p")
    assert slept == [7.0]
