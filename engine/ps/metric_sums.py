"""The server's exact metric accumulators (the ``Metric`` request): evaluation histograms merged across
workers, preemption requests, the online job's next-partition decisions. In memory only, dropped with
every generation change (``PSServer._drop_transient``)."""
from __future__ import annotations

import threading

import numpy as np

from ..errors import ProtocolError
from . import codec
from . import ps_pb2 as pb

__all__ = ["MetricSums"]


class MetricSums:
    """Named accumulators of ``counts : int64[c]`` and ``sums : float64[s]``."""

    def __init__(self):
        self._acc: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # name -> (int64 counts, float64 sums)
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._acc.clear()

    def handle(self, req: pb.MetricRequest) -> pb.MetricResponse | codec.Wire:
        """ADD ``counts`` and ``sums`` into accumulator ``table`` (created by the first ADD), READ them
        (empty when absent), or RESET (remove) it.

        Raises
        ------
        ProtocolError
            No name, non-finite sums, shapes unlike the accumulator's, or an unknown op (nothing changed).
        """
        name = req.table
        if not name:
            raise ProtocolError("table: a metric accumulator needs a name")
        resp = pb.MetricResponse(request_id=req.request_id)
        if req.op == pb.METRIC_ADD:
            counts = codec.decode(req.counts, "counts", codec.I64, 1)
            sums = codec.decode(req.sums, "sums", codec.F64, 1)
            if not np.isfinite(sums).all():
                raise ProtocolError("sums: contains NaN or Inf; nothing changed")
            with self._lock:
                acc = self._acc.get(name)
                if acc is None:
                    self._acc[name] = (counts.astype(np.int64), sums.astype(np.float64))
                elif acc[0].shape != counts.shape or acc[1].shape != sums.shape:
                    raise ProtocolError(f"metric {name!r} holds int64[{len(acc[0])}] counts and "
                                        f"float64[{len(acc[1])}] sums, got int64[{len(counts)}] and "
                                        f"float64[{len(sums)}]")
                else:
                    acc[0][:] += counts
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
                self._acc.pop(name, None)
            return resp
        raise ProtocolError(f"unknown metric op {req.op}")
