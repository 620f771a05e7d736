"""A software prefetch hint usable inside Numba kernels.

``prefetch(arr, i)`` asks the CPU to bring the cache line holding ``arr[i]`` (1-D) or the start of row
``arr[i]`` (2-D) into cache, without blocking. Hash-table probes and row gathers are random memory
accesses; issuing the load for item ``i + k`` while working on item ``i`` overlaps their latencies. With
``NUMBA_DISABLE_JIT=1`` it is a no-op Python function.
"""
from __future__ import annotations

from numba.core import config

if config.DISABLE_JIT:  # pragma: no cover - exercised by the no-JIT test run

    def prefetch(arr, i):  # noqa: D103
        return None

else:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, arr, i):
        if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
            return None
        sig = types.void(arr, i)

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args
            ary = context.make_array(aryty)(context, builder, args[0])
            idx = context.cast(builder, args[1], idxty, types.intp)
            zero = context.get_constant(types.intp, 0)
            inds = [idx] + [zero] * (aryty.ndim - 1)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            # rw=0 (read), locality=3 (keep in all cache levels), cache type=1 (data)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return sig, codegen
