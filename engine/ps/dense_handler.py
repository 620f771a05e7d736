"""The ``Dense`` RPC of ``PSServer``: one block of one dense table per request (``ps.proto``: DenseOp).

``dense(core, req)`` runs a request on ``core`` (the ``PSServer``); ``reread(core, req)`` answers a repeat
of an applied write whose reply left the reply window; ``mutating(req)`` says whether a request may change
state (and so is answered at most once). Replies that carry arrays are built in place
(``codec.Wire.allocate_fields``): the block's parameters (and moments) are copied straight into the
bytes handed to gRPC.

Ops: PULL (parameters), GRAD / DELTA / STEP (updates; STEP replies with the fresh parameters), INIT
(first writer wins unless forced), STATE_PULL (parameters, Adam's m, v and t of the block, read under
its lock) and STATE_SET (all of them at once; validated completely first, naming the block and the
field: a refused request changes nothing).
"""
from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from . import codec
from . import ps_pb2 as pb
from .hosts import invalid

#: ops that only read (not remembered by the reply window, retried on a deadline)
READ_OPS = frozenset({pb.DENSE_PULL, pb.DENSE_STATE_PULL})


def mutating(req) -> bool:
    """Whether a Dense request may change server state."""
    return req.op not in READ_OPS


def _state_array(t, name: str, block: int):
    """A STATE_SET array field -> float32[n] (None when absent); INVALID_ARGUMENT naming the block."""
    if codec.is_absent(t):
        return None
    try:
        return codec.decode(t, name, codec.F32, 1)
    except ProtocolError as e:
        raise invalid(f"block {block} {e}; nothing changed") from None


def dense(core, req) -> codec.Wire:
    """Run one Dense request on ``core`` (a ``PSServer``) -> its reply.

    Raises
    ------
    HostError, ProtocolError
        Refused (the server's ``handle`` adds the server, table and request id); nothing changed.
    """
    host = core._dense(req.table)
    resp = core._msg(pb.DenseResponse, req)
    reply = None

    def sized(resp):
        resp.size, resp.num_blocks, resp.block_size = host.size or 0, host.num_blocks, codec.DENSE_BLOCK
        return resp

    def reply_buffer() -> np.ndarray:   # the fresh parameters go straight into the reply's bytes
        nonlocal reply
        reply = codec.Wire.allocate(sized(resp), "values", codec.F32, (host.block_length(req.block),))
        return reply.arrays["values"]
    if req.op == pb.DENSE_INIT:
        host.check_size(int(req.size))              # before its block count and values are looked at
        n = -(-req.size // codec.DENSE_BLOCK)
        length = min(codec.DENSE_BLOCK, req.size - req.block * codec.DENSE_BLOCK)
        if not 0 <= req.block < n:
            raise ProtocolError(f"block {req.block} out of range for size {req.size}")
        init = codec.decode(req.values, "values", codec.F32, 1, shape=(length,))
        resp.applied = host.init(req.block, int(req.size), init, req.force)
    elif req.op == pb.DENSE_PULL:
        host.check_block(req.block)                 # errors before a reply is allocated
        host.pull(req.block, out=reply_buffer())
    elif req.op in (pb.DENSE_GRAD, pb.DENSE_DELTA, pb.DENSE_STEP):
        host.check_block(req.block)
        update = codec.decode(req.values, "values", codec.F32, 1, shape=(host.block_length(req.block),))
        if req.op == pb.DENSE_STEP:
            if req.accumulate:
                raise ProtocolError("DENSE_STEP cannot accumulate: sync mode pushes DENSE_GRAD with "
                                    "accumulate and pulls after the applying barrier")
            host.step(req.block, update, out=reply_buffer())
        elif req.op == pb.DENSE_GRAD:
            host.grad(req.block, update, req.accumulate)
        else:
            host.delta(req.block, update)
    elif req.op == pb.DENSE_STATE_PULL:
        host.check_block(req.block)
        length = host.block_length(req.block)
        adam = host.config.optimizer == "adam"
        resp.optimizer = host.config.optimizer
        # t goes into the reply's head, laid out before the arrays: one consistent copy first (a rare op)
        st = host.state(req.block)
        resp.t = st.t or 0
        names = ("values", "m", "v") if adam else ("values",)
        reply = codec.Wire.allocate_fields(sized(resp), {n: (codec.F32, (length,)) for n in names})
        for name, arr in zip(names, (st.params, st.m, st.v)):
            reply.arrays[name][:] = arr
    elif req.op == pb.DENSE_STATE_SET:
        if req.accumulate or req.force:
            raise ProtocolError("DENSE_STATE_SET takes neither accumulate nor force")
        params = _state_array(req.values, "values", req.block)
        if params is None:
            raise invalid(f"block {req.block} values: the parameters are missing; nothing changed")
        host.set_state(req.block, int(req.size), params, _state_array(req.m, "m", req.block),
                       _state_array(req.v, "v", req.block), int(req.t))
        resp.applied = True
    else:
        raise ProtocolError(f"unknown dense op {req.op}")
    return reply if reply is not None else codec.Wire(sized(resp))


def reread(core, req):
    """A repeat of an applied Dense write whose reply left the reply window: STEP answers with the
    block's parameters read now; STATE_SET (idempotent, its reply carries no data) answers applied;
    anything else returns None (the caller raises ``Expired``). Nothing changes."""
    if req.op == pb.DENSE_STEP:
        return dense(core, pb.DenseRequest(table=req.table, request_id=req.request_id, block=req.block,
                                           op=pb.DENSE_PULL))
    if req.op == pb.DENSE_STATE_SET:
        host = core._dense(req.table)
        resp = core._msg(pb.DenseResponse, req, applied=True)
        resp.size, resp.num_blocks, resp.block_size = host.size or 0, host.num_blocks, codec.DENSE_BLOCK
        return codec.Wire(resp)
    return None
