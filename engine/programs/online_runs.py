"""The partitions an online run consumed, as its checkpoints record them (manifest ``extra.run.partitions``),
in ranges of consecutive hours.

Every checkpoint of an online job records the partitions its ``engine train`` run consumed so far, so a
restarted attempt continues the run's count (``model.max_partitions``) and its list (the final line's
``partitions``). Listed one name a partition, a run of a year made every hourly manifest 8,760 names
(~130 KB) and growing, written and parsed again at every hour. Recorded here as ranges:
``"20240101/00..20240131/23"`` stands for every hour from the first to the last, both included; a name
alone stands for itself. A run over consecutive hours is one entry whatever its length; each gap (a
missing hour skipped) or repeat starts another.

Compatibility: a manifest written before (one name an entry) is read the same way (a list of names is
a list of ranges of one hour each). ``extra.run.partitions_count`` holds the number of partitions the
ranges stand for, checked when they are read.
"""
from __future__ import annotations

import datetime as _dt
import re

__all__ = ["RANGE_SEP", "compact", "expand"]

#: between the first and the last hour of a range
RANGE_SEP = ".."
_NAME = re.compile(r"(\d{4})(\d{2})(\d{2})/(\d{2})")
_EPOCH = _dt.datetime(1970, 1, 1)


def _hour(name: str) -> int:
    """``"20240101/05"`` -> hours since the Unix epoch. ValueError: not a partition name."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"expected a partition name YYYYMMDD/HH, got {name!r}")
    try:
        when = _dt.datetime(*map(int, m.groups()))
    except ValueError:
        raise ValueError(f"expected a partition name YYYYMMDD/HH, got {name!r}") from None
    return int((when - _EPOCH).total_seconds()) // 3600


def _name(hour: int) -> str:
    return (_EPOCH + _dt.timedelta(hours=hour)).strftime("%Y%m%d/%H")


def compact(names: list[str]) -> list[str]:
    """``names`` (partition names ``YYYYMMDD/HH`` in the order consumed) as ranges: a name, or
    ``"{first}..{last}"`` for two or more consecutive hours. ``expand(compact(names)) == names``.

    Raises
    ------
    ValueError
        A name is not a partition name (naming it).
    """
    out: list[str] = []
    first = last = None
    for name in names:
        h = _hour(name)
        if last is not None and h == last + 1:
            last = h
            continue
        if first is not None:
            out.append(_entry(first, last))
        first = last = h
    if first is not None:
        out.append(_entry(first, last))
    return out


def _entry(first: int, last: int) -> str:
    return _name(first) if first == last else f"{_name(first)}{RANGE_SEP}{_name(last)}"


def expand(entries: list[str], count: int | None = None) -> list[str]:
    """The partition names ``entries`` (``compact``'s ranges, or plain names as manifests written before
    them held) stand for, in order.

    ``count``: the number of names they must stand for (``extra.run.partitions_count``), when known.

    Raises
    ------
    ValueError
        An entry is no name nor range, a range ends before it starts, or ``count`` differs (naming it).
    """
    if not isinstance(entries, list):
        raise ValueError(f"expected a list of partition names and ranges, got {type(entries).__name__}")
    out: list[str] = []
    for e in entries:
        a, sep, b = e.partition(RANGE_SEP) if isinstance(e, str) else (e, "", "")
        if not sep:
            _hour(a)
            out.append(a)
            continue
        first, last = _hour(a), _hour(b)
        if last < first:
            raise ValueError(f"partition range {e!r} ends before it starts")
        out.extend(_name(h) for h in range(first, last + 1))
    if count is not None and count != len(out):
        raise ValueError(f"partitions_count is {count} but the ranges stand for {len(out)} partitions")
    return out
