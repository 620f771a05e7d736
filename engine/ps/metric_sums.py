"""The server's exact metric accumulators (the ``Metric`` request): evaluation histograms merged across
workers, preemption requests, the online job's next-partition decisions. In memory only, dropped with
every generation change (``PSServer._drop_transient``).

Bounds (what a client with the worker token can make a server hold): names of at most
``MAX_NAME_CHARS`` characters, at most ``MAX_ACCUMULATORS`` accumulators of ``MAX_BYTES`` in all (an
evaluation histogram is 1 MiB: ``2 * 2^16 + 1`` counts), counts whose sums never wrap around int64 (a
count may be negative: the online job's decisions add ``END = -1``, ``engine.programs.online_next``)."""
from __future__ import annotations

import threading

import numpy as np

from ..errors import ProtocolError
from . import codec
from . import ps_pb2 as pb
from .hosts import HostError

__all__ = ["MAX_ACCUMULATORS", "MAX_BYTES", "MAX_NAME_CHARS", "MetricSums"]

#: the longest accumulator name
MAX_NAME_CHARS = 256
#: the most accumulators a server holds at once
MAX_ACCUMULATORS = 1024
#: the most bytes (counts and sums) of all accumulators together
MAX_BYTES = 64 << 20


class MetricSums:
    """Named accumulators of ``counts : int64[c]`` and ``sums : float64[s]``."""

    def __init__(self):
        self._acc: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # name -> (int64 counts, float64 sums)
        self._bytes = 0                                            # of every accumulator's arrays
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._acc.clear()
            self._bytes = 0

    def handle(self, req: pb.MetricRequest) -> pb.MetricResponse | codec.Wire:
        """ADD ``counts`` and ``sums`` into accumulator ``table`` (created by the first ADD), READ them
        (empty when absent), or RESET (remove) it.

        Raises
        ------
        ProtocolError
            No name or one over ``MAX_NAME_CHARS``, non-finite sums, shapes unlike the accumulator's,
            or an unknown op (nothing changed).
        HostError
            OUT_OF_RANGE: a count's sum would leave the int64 range; FAILED_PRECONDITION: a new
            accumulator would pass ``MAX_ACCUMULATORS`` or ``MAX_BYTES`` (nothing changed).
        """
        name = req.table
        if not name:
            raise ProtocolError("table: a metric accumulator needs a name")
        if len(name) > MAX_NAME_CHARS:
            raise ProtocolError(f"table: a metric accumulator's name has at most {MAX_NAME_CHARS} characters, "
                                f"got {len(name)}")
        resp = pb.MetricResponse(request_id=req.request_id)
        if req.op == pb.METRIC_ADD:
            counts = codec.decode(req.counts, "counts", codec.I64, 1)
            sums = codec.decode(req.sums, "sums", codec.F64, 1)
            if not np.isfinite(sums).all():
                raise ProtocolError("sums: contains NaN or Inf; nothing changed")
            with self._lock:
                acc = self._acc.get(name)
                if acc is None:
                    self._create(name, counts, sums)
                elif acc[0].shape != counts.shape or acc[1].shape != sums.shape:
                    raise ProtocolError(f"metric {name!r} holds int64[{len(acc[0])}] counts and "
                                        f"float64[{len(acc[1])}] sums, got int64[{len(counts)}] and "
                                        f"float64[{len(sums)}]")
                else:
                    total = acc[0] + counts         # wraps around; a wrapped sum has the other sign of both
                    over = np.flatnonzero(((acc[0] ^ total) & (counts ^ total)) < 0)
                    if len(over):
                        i = int(over[0])
                        raise HostError("OUT_OF_RANGE", f"counts: metric {name!r} at index {i} holds "
                                        f"{int(acc[0][i])}; adding {int(counts[i])} would pass the int64 "
                                        f"range; nothing changed")
                    acc[0][:] = total
                    acc[1][:] += sums
            return resp
        if req.op == pb.METRIC_READ:
            with self._lock:
                acc = self._acc.get(name)
                counts, sums = ((acc[0].copy(), acc[1].copy()) if acc is not None
                                else (np.zeros(0, np.int64), np.zeros(0, np.float64)))
            return codec.Wire(resp, counts=counts, sums=sums)
        if req.op == pb.METRIC_RESET:
            with self._lock:
                acc = self._acc.pop(name, None)
                if acc is not None:
                    self._bytes -= acc[0].nbytes + acc[1].nbytes
            return resp
        raise ProtocolError(f"unknown metric op {req.op}")

    def _create(self, name: str, counts: np.ndarray, sums: np.ndarray) -> None:
        """A new accumulator (caller holds the lock), within ``MAX_ACCUMULATORS`` and ``MAX_BYTES``."""
        size = counts.nbytes + sums.nbytes
        if len(self._acc) >= MAX_ACCUMULATORS or self._bytes + size > MAX_BYTES:
            raise HostError("FAILED_PRECONDITION", f"metric {name!r}: this server holds {len(self._acc)} metric "
                            f"accumulators of {self._bytes} bytes; a new one of {size} bytes would pass "
                            f"{MAX_ACCUMULATORS} accumulators or {MAX_BYTES} bytes (engine.ps.metric_sums): "
                            f"reset the ones no longer read (PSClient.reset_metric); nothing changed")
        self._acc[name] = (counts.astype(np.int64), sums.astype(np.float64))
        self._bytes += size
