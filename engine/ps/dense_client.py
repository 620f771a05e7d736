"""The dense-table half of ``PSClient`` (``DenseClient``, a mixin): dense tables cut into blocks of
``codec.DENSE_BLOCK`` floats, block ``b`` of a table on server ``(ordinal + b) % num_servers``.

Parameters travel with ``init_dense`` / ``pull_dense`` / ``push_dense`` / ``push_pull_dense`` /
``push_dense_delta``; the whole optimizer state (parameters, Adam's moments ``m``, ``v`` and step count
``t`` of every block) with ``pull_dense_state`` / ``set_dense_state``, e.g. for hybrid mode, whose
workers hold the dense tower and keep the servers' copy (the checkpointed one) current::

    >>> st = client.pull_dense_state("dense")      # DenseOptimizerState
    >>> st.params.shape, st.m.dtype, st.t          # (P,), float32, int64[num_blocks]
    >>> client.set_dense_state("dense", st)        # admin token; all blocks or a clear error

The mixin uses ``PSClient``'s plumbing (``info``, ``_call``, ``_fan_out``, ``_rid``, ``num_servers``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MessageTooLargeError, ProtocolError, RequestRejectedError
from . import _arrays, codec
from . import ps_pb2 as pb


@dataclass
class DenseOptimizerState:
    """The whole optimizer state of one dense table of ``P`` floats in ``B`` blocks.

    Attributes
    ----------
    params : float32[P]
    m, v : float32[P] or None
        Adam's first and second moments (``v >= 0``); None for SGD.
    t : int64[B]
        Adam's step count of each block (the servers step each block with its own optimizer; all blocks
        of a table step together, so they normally agree: ``step``); zeros for SGD.
    optimizer : str
        ``"adam"`` or ``"sgd"``.
    """

    params: np.ndarray
    m: np.ndarray | None
    v: np.ndarray | None
    t: np.ndarray
    optimizer: str

    @property
    def step(self) -> int:
        """The step count shared by every block.

        Raises
        ------
        ProtocolError
            The blocks' counts differ (an optimizer over the whole vector cannot take this state).
        """
        ts = np.unique(self.t)
        if len(ts) != 1:
            raise ProtocolError(f"the dense table's blocks were stepped unequally: step counts t per block "
                                f"{self.t.tolist()}; one optimizer over the whole table needs one t")
        return int(ts[0])


#: a dense-state message's bytes beyond its arrays (ids, shapes, tags), generously
_STATE_OVERHEAD_BYTES = 4096


class DenseClient:
    """Dense-table calls of ``PSClient`` (see the module docstring)."""

    def _dense(self, table: str) -> dict:
        info = self.info()
        if table not in info["dense"]:
            raise RequestRejectedError("NOT_FOUND", f"unknown dense table {table!r}; the servers host "
                                       f"{sorted(info['dense'])}")
        return info["dense"][table]

    def _blocks(self, table: str, size: int) -> list[tuple[int, int, int, int]]:
        """[(block, server, start, stop)] of a dense table of ``size`` floats."""
        d = self._dense(table)
        bs = codec.DENSE_BLOCK
        return [(b, (d["ordinal"] + b) % self.num_servers, b * bs, min(size, (b + 1) * bs))
                for b in range(max(1, -(-size // bs)))]

    def _dense_size(self, table: str) -> int:
        d = self._dense(table)
        if not d.get("size"):
            owner = d["ordinal"] % self.num_servers
            r = self._call(owner, "Dense", pb.DenseRequest(table=table, request_id=self._rid(), block=0,
                                                           op=pb.DENSE_PULL), idempotent=True)
            d["size"] = int(r.size)
        return d["size"]

    def init_dense(self, table: str, params: np.ndarray, *, force: bool = False) -> bool:
        """Set a dense table's initial ``params : float32[P]`` unless already set (first writer wins;
        ``force`` overwrites). Returns True if every block was set by this call."""
        params = _arrays.check_array(params, (None,), "params")
        rid = self._rid()
        calls = [(s, "Dense", codec.Wire(pb.DenseRequest(table=table, request_id=f"{rid}.{b}", block=b,
                                                         op=pb.DENSE_INIT, size=len(params), force=force),
                                         values=params[a:z]))
                 for b, s, a, z in self._blocks(table, len(params))]
        replies = self._fan_out(calls, idempotent=False)
        self._dense(table)["size"] = len(params)
        return all(r.applied for r in replies)

    def pull_dense(self, table: str) -> np.ndarray:
        """The current parameters of a dense table -> float32[P].

        Raises
        ------
        RequestRejectedError
            FAILED_PRECONDITION when the table was never initialized (``init_dense``).
        """
        size = self._dense_size(table)
        rid = self._rid()
        blocks = self._blocks(table, size)
        replies = self._fan_out([(s, "Dense", pb.DenseRequest(table=table, request_id=f"{rid}.{b}", block=b,
                                                              op=pb.DENSE_PULL))
                                 for b, s, a, z in blocks], idempotent=True)
        out = np.empty(size, np.float32)
        for (b, s, a, z), r in zip(blocks, replies):
            out[a:z] = codec.decode(r.values, "values", codec.F32, 1, shape=(z - a,))
        return out

    def push_dense(self, table: str, grad: np.ndarray, *, accumulate: bool = False) -> None:
        """Optimizer step on the servers with ``grad : float32[P]`` (``accumulate``: sync mode)."""
        self._dense_op(table, grad, pb.DENSE_GRAD, accumulate)

    def push_pull_dense(self, table: str, grad: np.ndarray) -> np.ndarray:
        """Async mode in one round trip: optimizer step on the servers with ``grad : float32[P]``, then
        the fresh parameters -> float32[P] (each block's values right after its own update; what
        ``push_dense`` followed by ``pull_dense`` gives without concurrent writers). A table of one
        block (up to DENSE_BLOCK floats) comes back as a read-only view of the reply, not a copy.

        Raises
        ------
        ProtocolError
            ``grad`` is not float32[P] or not finite (nothing sent).
        RequestRejectedError, ShardUnavailableError, PSTimeoutError
        """
        size = self._dense_size(table)
        grad = _arrays.check_array(grad, (size,), "grad")
        rid = self._rid()
        blocks = self._blocks(table, size)
        replies = self._fan_out([(s, "Dense", codec.Wire(pb.DenseRequest(table=table, request_id=f"{rid}.{b}",
                                                                         block=b, op=pb.DENSE_STEP),
                                                         values=grad[a:z]))
                                 for b, s, a, z in blocks], idempotent=False)
        if len(blocks) == 1:
            return codec.decode(replies[0].values, "values", codec.F32, 1, shape=(size,))
        out = np.empty(size, np.float32)
        for (b, s, a, z), r in zip(blocks, replies):
            out[a:z] = codec.decode(r.values, "values", codec.F32, 1, shape=(z - a,))
        return out


    def push_dense_delta(self, table: str, delta: np.ndarray) -> None:
        """GEO: ``params += delta : float32[P]`` on the servers."""
        self._dense_op(table, delta, pb.DENSE_DELTA, False)

    def _dense_op(self, table, values, op, accumulate) -> None:
        size = self._dense_size(table)
        values = _arrays.check_array(values, (size,), "grad" if op == pb.DENSE_GRAD else "delta")
        rid = self._rid()
        self._fan_out([(s, "Dense", codec.Wire(pb.DenseRequest(table=table, request_id=f"{rid}.{b}", block=b,
                                                               op=op, accumulate=accumulate),
                                               values=values[a:z]))
                       for b, s, a, z in self._blocks(table, size)], idempotent=False)


    # ------------------------------------------------------------------ whole optimizer state
    def _state_fits(self, table: str, blocks: list, arrays: int) -> None:
        """Raise MessageTooLargeError (before anything is sent) when one block's state of ``arrays``
        float32 arrays would exceed the servers' message limit."""
        limit = self.info()["max_message_bytes"]
        longest = max(z - a for _, _, a, z in blocks)
        need = arrays * 4 * longest + _STATE_OVERHEAD_BYTES
        if need > limit:
            raise MessageTooLargeError(
                "RESOURCE_EXHAUSTED", f"dense table {table!r}: the optimizer state of one block ({arrays} x "
                f"{longest} float32, {need} bytes with headers) exceeds the message limit of {limit} bytes "
                f"(server.max_message_bytes): raise it to at least {need}; nothing was sent")

    def pull_dense_state(self, table: str) -> DenseOptimizerState:
        """The whole optimizer state of a dense table: parameters and, for Adam, the moments and the step
        count of every block (read on each block's server, block by block consistent).

        Returns
        -------
        DenseOptimizerState
            ``params, m, v : float32[P]`` (m, v None for SGD), ``t : int64[B]`` per block.

        Raises
        ------
        RequestRejectedError
            FAILED_PRECONDITION when the table was never initialized (``init_dense``); NOT_FOUND for an
            unknown table.
        MessageTooLargeError
            One block's state would exceed ``server.max_message_bytes`` (nothing sent).
        ProtocolError
            A reply that does not fit the table (wrong lengths, servers disagreeing on the optimizer).
        ShardUnavailableError, PSTimeoutError
        """
        size = self._dense_size(table)
        blocks = self._blocks(table, size)
        self._state_fits(table, blocks, 3)
        rid = self._rid()
        replies = self._fan_out([(s, "Dense", pb.DenseRequest(table=table, request_id=f"{rid}.{b}", block=b,
                                                              op=pb.DENSE_STATE_PULL))
                                 for b, s, a, z in blocks], idempotent=True)
        kinds = {r.optimizer for r in replies}
        if len(kinds) != 1 or not kinds <= {"adam", "sgd"}:
            raise ProtocolError(f"dense table {table!r}: the servers report optimizers {sorted(kinds)} for its "
                                f"blocks; expected one of 'adam' or 'sgd'")
        kind = kinds.pop()
        adam = kind == "adam"
        params = np.empty(size, np.float32)
        m = np.empty(size, np.float32) if adam else None
        v = np.empty(size, np.float32) if adam else None
        t = np.zeros(len(blocks), np.int64)
        for i, ((b, s, a, z), r) in enumerate(zip(blocks, replies)):
            params[a:z] = codec.decode(r.values, "values", codec.F32, 1, shape=(z - a,))
            if adam:
                m[a:z] = codec.decode(r.m, "m", codec.F32, 1, shape=(z - a,))
                v[a:z] = codec.decode(r.v, "v", codec.F32, 1, shape=(z - a,))
                t[i] = r.t
        return DenseOptimizerState(params, m, v, t, kind)

    def set_dense_state(self, table: str, state: DenseOptimizerState) -> None:
        """Set the whole optimizer state of a dense table on its servers (each block's parameters,
        moments and step count at once), initializing the table with ``len(state.params)`` floats when
        a server has not seen it. Needs the admin token when the cluster has tokens (it overwrites the
        trained table, as a forced ``init_dense``). Idempotent: a retried request sets the same state.

        Parameters
        ----------
        state : DenseOptimizerState
            ``params : float32[P]``; for an Adam table ``m, v : float32[P]`` (v >= 0) and ``t`` an int
            >= 0 or ``int64[B]`` per block; for SGD ``m = v = None``.

        Raises
        ------
        ProtocolError
            Wrong dtype or length, NaN/Inf, negative ``v`` or ``t``, moments for an SGD table or none for
            an Adam table (checked here; nothing sent).
        RequestRejectedError
            A server refused a block (INVALID_ARGUMENT naming the block and the field; that block is
            unchanged; blocks on other servers may have been set: call again to retry);
            ``AccessDeniedError`` without the admin token.
        MessageTooLargeError
            One block's state would exceed ``server.max_message_bytes`` (nothing sent).
        ShardUnavailableError, PSTimeoutError
        """
        params = _arrays.check_array(state.params, (None,), "params")
        size = len(params)
        blocks = self._blocks(table, size)
        adam = state.optimizer == "adam"
        if state.optimizer not in ("adam", "sgd"):
            raise ProtocolError(f"optimizer: expected 'adam' or 'sgd', got {state.optimizer!r}")
        t = np.broadcast_to(np.asarray(state.t, np.int64), (len(blocks),)) if np.ndim(state.t) == 0 \
            else np.asarray(state.t)
        if adam:
            m = _arrays.check_array(state.m, (size,), "m")
            v = _arrays.check_array(state.v, (size,), "v")
            if not (v >= 0).all():
                raise ProtocolError(f"v: Adam's second moment must be >= 0, got {float(v.min())} at "
                                    f"{int(np.argmin(v))}; nothing was sent")
            if t.shape != (len(blocks),) or not np.issubdtype(t.dtype, np.integer) or (t < 0).any():
                raise ProtocolError(f"t: expected an int >= 0 or int64[{len(blocks)}] (one per block) >= 0, "
                                    f"got {state.t!r}")
        else:
            if state.m is not None or state.v is not None:
                raise ProtocolError("m, v: an SGD table has no moments; pass m=None, v=None")
            m = v = None
        self._state_fits(table, blocks, 3 if adam else 1)
        rid = self._rid()
        calls = []
        for i, (b, s, a, z) in enumerate(blocks):
            req = pb.DenseRequest(table=table, request_id=f"{rid}.{b}", block=b, op=pb.DENSE_STATE_SET,
                                  size=size, t=int(t[i]) if adam else 0)
            calls.append((s, "Dense", codec.Wire(req, values=params[a:z], m=None if m is None else m[a:z],
                                                 v=None if v is None else v[a:z])))
        self._fan_out(calls, idempotent=True)      # setting the same state twice is harmless
        self._dense(table)["size"] = size
