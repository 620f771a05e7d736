"""``DenseHost``: the blocks of one dense table that this server owns (``hosts`` holds the sparse side).

It validates a whole request before touching any block, so a rejected request leaves the table
unchanged. Errors are ``hosts.HostError`` carrying a gRPC status code name; the server adds the server,
table and request id to the message.
"""
from __future__ import annotations

import threading

import numpy as np

from models.optim import SGD, Adam

from ..checkpoint.writer import DenseBlockState, DenseState
from ..config import DenseTableConfig
from . import _kernels
from .codec import DENSE_BLOCK
from .hosts import HostError, copy_out, invalid

#: default of ``server.max_dense_floats``: the largest dense table a client may initialize (2^25 floats,
#: 128 MiB of parameters; the shipped models have under 500 000)
MAX_DENSE_FLOATS = 1 << 25


class _Block:
    def __init__(self, length: int, cfg: DenseTableConfig):
        self.params = np.zeros(length, np.float32)
        self.initialized = False
        if cfg.optimizer == "adam":
            self.opt = Adam(length, cfg.learning_rate, cfg.beta1, cfg.beta2, cfg.epsilon)
        else:
            self.opt = SGD(length, cfg.learning_rate)
        self.pending = np.zeros(length, np.float32)
        self.pending_n = 0
        self.lock = threading.Lock()


class DenseHost:
    """The blocks of one dense table owned by this server.

    A dense table of ``size`` floats is cut into blocks of ``DENSE_BLOCK`` floats; block ``b`` lives on
    server ``(ordinal + b) % num_servers`` (``ordinal``: the table's position among the dense tables in
    name order), so big tables spread over the servers. Each block has its own optimizer; Adam and SGD
    are element-wise, so this equals one optimizer over the whole vector.
    """

    def __init__(self, name: str, config: DenseTableConfig, *, ordinal: int, server: int,
                 num_servers: int, max_floats: int = MAX_DENSE_FLOATS):
        self.name, self.config = name, config
        self.ordinal, self.server, self.num_servers = ordinal, server, num_servers
        self.max_floats = int(max_floats)        # the largest size a client may initialize it with
        self.size: int | None = None
        self.blocks: dict[int, _Block] = {}
        self._lock = threading.Lock()

    def owner(self, block: int) -> int:
        return (self.ordinal + block) % self.num_servers

    @property
    def num_blocks(self) -> int:
        return 0 if self.size is None else max(1, -(-self.size // DENSE_BLOCK))

    def block_length(self, block: int) -> int:
        return min(DENSE_BLOCK, self.size - block * DENSE_BLOCK) if self.size else 0

    def _block(self, block: int) -> _Block:
        if self.size is None:
            raise HostError("FAILED_PRECONDITION", f"dense table {self.name!r} is not initialized: "
                            f"call PSClient.init_dense(table, params) first")
        if not 0 <= block < self.num_blocks:
            raise invalid(f"block {block} out of range: the table has {self.num_blocks} blocks")
        if self.owner(block) != self.server:
            raise invalid(f"block {block} lives on server {self.owner(block)}, not on this one")
        return self.blocks[block]

    def check_block(self, block: int) -> None:
        """Raise HostError unless the table is initialized and ``block`` exists and lives here."""
        self._block(block)

    def _check(self, block: int, values: np.ndarray, what: str) -> _Block:
        b = self._block(block)
        if values.shape != b.params.shape:
            raise invalid(f"{what}: expected float32[{len(b.params)}] for block {block}, "
                          f"got float32{list(values.shape)}")
        if not _kernels.all_finite(values):
            raise invalid(f"{what} of block {block} is not finite (NaN or Inf); nothing changed")
        return b

    def check_grad(self, block: int, grad: np.ndarray) -> None:
        """Raise HostError unless ``grad`` fits ``block`` (which lives here) and is finite."""
        self._check(block, grad, "grad")

    def check_size(self, size: int) -> None:
        """Raise HostError INVALID_ARGUMENT naming ``size`` unless a client may initialize the table with
        ``size`` floats: 1 <= size <= ``max_floats`` (``server.max_dense_floats``), and the table's own
        size once it has one."""
        if size < 1:
            raise invalid(f"size: a dense table has >= 1 floats, got {size}")
        if size > self.max_floats:
            raise invalid(f"size: {size} floats is more than server.max_dense_floats = {self.max_floats} "
                          f"(raise it in the servers' config for a larger model); nothing allocated")
        if self.size is not None and size != self.size:
            raise invalid(f"size: init with size {size}, but the table was initialized with size {self.size}")

    def _sized(self, size: int) -> None:
        """Allocate the blocks this server owns of a table of ``size`` floats (first call), or raise
        HostError INVALID_ARGUMENT (``check_size``). The blocks are built before the table takes the
        size: an allocation that fails (MemoryError) leaves it uninitialized."""
        with self._lock:
            self.check_size(size)
            if self.size is None:
                n_blocks = max(1, -(-size // DENSE_BLOCK))
                blocks = {bl: _Block(min(DENSE_BLOCK, size - bl * DENSE_BLOCK), self.config)
                          for bl in range(n_blocks) if self.owner(bl) == self.server}
                self.blocks, self.size = blocks, size

    def clear(self) -> None:
        """Forget the table: not initialized again until the next ``init`` (a roll-back to a job's
        beginning)."""
        with self._lock:
            self.size = None
            self.blocks = {}

    def init(self, block: int, size: int, values: np.ndarray, force: bool) -> bool:
        self._sized(size)
        b = self._check(block, values, "values")
        with b.lock:
            if b.initialized and not force:
                return False
            b.params[:] = values
            b.initialized = True
            return True

    def state(self, block: int, out: tuple | None = None) -> DenseBlockState:
        """A consistent copy of the block's whole optimizer state, read under the block lock:
        ``params : float32[L]``, for Adam ``m, v : float32[L]`` and ``t`` (int), else None. ``out``:
        ``(params, m, v)`` buffers to copy into (e.g. the reply's bytes; m, v ignored for SGD).

        Raises
        ------
        HostError
            FAILED_PRECONDITION (table not initialized), INVALID_ARGUMENT (block not here).
        """
        b = self._block(block)
        out = out or (None, None, None)
        with b.lock:
            params = copy_out(b.params, out[0])
            if not isinstance(b.opt, Adam):
                return DenseBlockState(params)
            return DenseBlockState(params, copy_out(b.opt.m, out[1]), copy_out(b.opt.v, out[2]), int(b.opt.t))

    def set_state(self, block: int, size: int, params: np.ndarray, m: np.ndarray | None,
                  v: np.ndarray | None, t: int) -> None:
        """Set the block's whole optimizer state at once (under the block lock), allocating the table
        with ``size`` floats first if this server has not seen it. Everything is checked before anything
        changes; setting the same state twice leaves the same state (a retry is harmless).

        Parameters
        ----------
        block, size : int
        params : float32[L]
        m, v : float32[L] or None
            Adam's moments (v >= 0), required for an Adam table, refused for SGD.
        t : int
            Adam's step count (>= 0); 0 for SGD.

        Raises
        ------
        HostError
            INVALID_ARGUMENT naming the block and the field (wrong length, NaN/Inf, v < 0, t < 0,
            moments that do not fit the table's optimizer, another size than the table's or one over
            ``max_floats``, a block that lives elsewhere); nothing changed.
        """
        if size < 1 or (self.size is not None and size != self.size):
            raise invalid(f"block {block}: size {size} given, the table has "
                          f"{self.size if self.size is not None else 'no size yet (size must be >= 1)'}")
        if size > self.max_floats:
            raise invalid(f"block {block}: size {size} floats is more than server.max_dense_floats = "
                          f"{self.max_floats}; nothing changed")
        n_blocks = max(1, -(-size // DENSE_BLOCK))
        if not 0 <= block < n_blocks:
            raise invalid(f"block {block} out of range: a table of {size} floats has {n_blocks} blocks")
        if self.owner(block) != self.server:
            raise invalid(f"block {block} lives on server {self.owner(block)}, not on this one")
        length = min(DENSE_BLOCK, size - block * DENSE_BLOCK)
        adam = self.config.optimizer == "adam"
        if adam and (m is None or v is None):
            raise invalid(f"block {block}: the table's optimizer is adam: its state needs m and v "
                          f"(float32[{length}] each); nothing changed")
        if not adam and (m is not None or v is not None or t):
            raise invalid(f"block {block}: the table's optimizer is {self.config.optimizer}: it has no "
                          f"moments or step count (m, v absent, t 0); nothing changed")
        for what, arr in (("values (params)", params), ("m", m), ("v", v)):
            if arr is None:
                continue
            if arr.shape != (length,):
                raise invalid(f"block {block} {what}: expected float32[{length}], got float32{list(arr.shape)}; "
                              f"nothing changed")
            if not _kernels.all_finite(arr):
                raise invalid(f"block {block} {what}: not finite (NaN or Inf); nothing changed")
        if v is not None and not (v >= 0).all():
            raise invalid(f"block {block} v: Adam's second moment must be >= 0, got {float(v.min())}; "
                          f"nothing changed")
        if t < 0:
            raise invalid(f"block {block} t: Adam's step count must be >= 0, got {t}; nothing changed")
        self._sized(size)
        b = self.blocks[block]
        with b.lock:
            b.params[:] = params
            if adam:
                b.opt.load_state_dict({"m": m, "v": v, "t": int(t)})
            b.initialized = True

    def pull(self, block: int, out: np.ndarray | None = None) -> np.ndarray:
        """A copy of the block's parameters (into ``out``, e.g. the reply buffer, when given)."""
        b = self._block(block)
        with b.lock:
            return copy_out(b.params, out)

    def grad(self, block: int, grad: np.ndarray, accumulate: bool) -> None:
        b = self._check(block, grad, "grad")
        with b.lock:
            if accumulate:
                b.pending += grad
                b.pending_n += 1
            else:
                b.opt.step(b.params, np.ascontiguousarray(grad, dtype=np.float32))

    def step(self, block: int, grad: np.ndarray, out: np.ndarray | None = None, *,
             checked: bool = False) -> np.ndarray:
        """Optimizer step with ``grad`` (async mode), then a copy of the block's fresh parameters (into
        ``out`` when given). ``checked``: ``check_grad`` already passed for this gradient."""
        b = self._block(block) if checked else self._check(block, grad, "grad")
        with b.lock:
            b.opt.step(b.params, np.ascontiguousarray(grad, dtype=np.float32))
            return copy_out(b.params, out)

    def delta(self, block: int, delta: np.ndarray) -> None:
        b = self._check(block, delta, "delta")
        with b.lock:
            b.params += delta

    def drop_pending(self) -> None:
        """Forget the sync gradients held for the next barrier (see ``SparseHost.drop_pending``)."""
        for b in self.blocks.values():
            with b.lock:
                b.pending[:] = 0
                b.pending_n = 0

    def apply_pending(self, world: int) -> None:
        for b in self.blocks.values():
            with b.lock:
                if b.pending_n:
                    b.opt.step(b.params, b.pending * np.float32(1.0 / world))
                    b.pending[:] = 0
                    b.pending_n = 0

    @property
    def nbytes(self) -> int:
        """Bytes of this server's blocks, estimated as four arrays of each block's parameters (the
        parameters, a merged gradient and up to two optimizer moments)."""
        return sum(4 * b.params.nbytes for b in list(self.blocks.values()))

    def stats(self) -> dict:
        return {"size": self.size, "num_blocks": self.num_blocks, "blocks_here": sorted(self.blocks),
                "optimizer": self.config.optimizer}

    def snapshot(self) -> DenseState | None:
        """Copies of this server's blocks with their optimizer state (None before init)."""
        if self.size is None:
            return None
        state = DenseState(self.size)
        for bl, b in self.blocks.items():
            with b.lock:
                if isinstance(b.opt, Adam):
                    st = b.opt.state_dict()
                    state.blocks[bl] = DenseBlockState(b.params.copy(), np.array(st["m"], np.float32),
                                                       np.array(st["v"], np.float32), int(st["t"]))
                else:
                    state.blocks[bl] = DenseBlockState(b.params.copy())
        return state

    def check_restore(self, size: int, blocks: dict) -> None:
        """Raise unless ``restore(size, blocks)`` would succeed; changes nothing.

        Raises
        ------
        HostError
            DATA_LOSS when a block this server owns is missing or has the wrong length (params, or
            Adam's m / v); FAILED_PRECONDITION when the table was initialized with another size.
        """
        if size < 1:
            raise HostError("DATA_LOSS", f"dense table {self.name!r}: the checkpoint gives size {size}")
        if self.size is not None and size != self.size:
            raise HostError("FAILED_PRECONDITION", f"dense table {self.name!r}: the checkpoint's table has "
                            f"{size} values, this server's has {self.size}; nothing was restored")
        adam = self.config.optimizer == "adam"
        for bl in range(max(1, -(-size // DENSE_BLOCK))):
            if self.owner(bl) != self.server:
                continue
            st = blocks.get(bl)
            if st is None:
                raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl} is missing from the "
                                f"checkpoint")
            length = min(DENSE_BLOCK, size - bl * DENSE_BLOCK)
            parts = [("params", st.params)] + ([("m", st.m), ("v", st.v)] if adam and st.m is not None else [])
            for what, arr in parts:
                if arr is None or np.shape(arr) != (length,):
                    got = None if arr is None else list(np.shape(arr))
                    raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl} {what}: expected "
                                    f"float32[{length}], the checkpoint has {got}")
                if not np.isfinite(arr).all():
                    raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl} {what}: the "
                                    f"checkpoint holds NaN or Inf")
            if adam and st.m is not None and st.t is None:
                raise HostError("DATA_LOSS", f"dense table {self.name!r}: block {bl}: Adam moments without "
                                f"their step count t")

    def restore(self, size: int, blocks: dict) -> int:
        """Set the blocks this server owns from a checkpoint (``DenseBlockState`` by block index).
        Everything is checked first (``check_restore``), so a failure changes nothing.

        Raises
        ------
        HostError
            As ``check_restore``.
        """
        self.check_restore(size, blocks)
        n = 0
        for bl in range(max(1, -(-size // DENSE_BLOCK))):
            if self.owner(bl) != self.server:
                continue
            st = blocks[bl]
            self.init(bl, size, st.params, force=True)
            b = self.blocks[bl]
            if isinstance(b.opt, Adam) and st.m is not None:
                b.opt.load_state_dict({"m": st.m, "v": st.v, "t": int(st.t)})
            n += 1
        return n
