"""A software prefetch hint usable inside Numba kernels.

``prefetch(arr, i)`` asks the CPU to bring the cache line holding ``arr[i]`` (1-D) or the start of row
``arr[i]`` (2-D) into cache, without blocking; ``prefetch_last(arr, i)`` the line holding the last
element of row ``i`` (2-D), for records that straddle two lines. Hash-table probes and row gathers are random memory
accesses; issuing the load for item ``i + k`` while working on item ``i`` overlaps their latencies. With
``NUMBA_DISABLE_JIT=1`` it is a no-op Python function.
"""
from __future__ import annotations

from numba.core import config

if config.DISABLE_JIT:  # pragma: no cover - exercised by the no-JIT test run

    def prefetch(arr, i):  # noqa: D103
        return None

    def prefetch_last(arr, i):  # noqa: D103
        return None

else:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    def _emit(context, builder, aryty, ary_val, inds):
        ary = context.make_array(aryty)(context, builder, ary_val)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # rw=0 (read), locality=3 (keep in all cache levels), cache type=1 (data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    @intrinsic
    def prefetch(typingctx, arr, i):
        if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args
            idx = context.cast(builder, args[1], idxty, types.intp)
            zero = context.get_constant(types.intp, 0)
            return _emit(context, builder, aryty, args[0], [idx] + [zero] * (aryty.ndim - 1))

        return types.void(arr, i), codegen

    @intrinsic
    def prefetch_last(typingctx, arr, i):
        if not isinstance(arr, types.Array) or arr.ndim != 2 or not isinstance(i, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args
            idx = context.cast(builder, args[1], idxty, types.intp)
            ary = context.make_array(aryty)(context, builder, args[0])
            ncols = cgutils.unpack_tuple(builder, ary.shape, 2)[1]
            last = builder.sub(ncols, context.get_constant(types.intp, 1))
            return _emit(context, builder, aryty, args[0], [idx, last])

        return types.void(arr, i), codegen
