"""A software prefetch hint usable inside numba kernels.

An online pass is bound by random reads of the weight table (one cache miss per non-zero on
data whose features do not fit the cache). While a row is being processed, prefetching the
table rows of the *next* example's features overlaps those misses with the current row's
arithmetic. The hint never faults and changes no result.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_FOR_WRITE = 1  # the pass writes these rows: fetch the line in exclusive state
_LOCALITY_HIGH = 3
_DATA_CACHE = 1


@intrinsic
def prefetch_row(typingctx, table, row):
    """Ask the CPU to start loading the cache line of ``table[row]`` (1-D) or ``table[row, 0]``
    (2-D), for a write; ``table`` is a C-contiguous array. No bounds check is needed: a
    prefetch of any address is harmless."""
    if not (isinstance(table, types.Array) and table.ndim in (1, 2) and isinstance(row, types.Integer)):
        return None
    sig = types.void(table, row)

    def codegen(context, builder, signature, args):
        table_ty, row_ty = signature.args
        arr = context.make_array(table_ty)(context, builder, args[0])
        idx = [context.cast(builder, args[1], row_ty, types.intp)]
        idx += [context.get_constant(types.intp, 0)] * (table_ty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, table_ty, arr, idx, wraparound=False)
        if getattr(ptr.type, "is_opaque", False):
            name, arg = "llvm.prefetch.p0", ptr
        else:  # typed pointers (older LLVM)
            i8p = ir.IntType(8).as_pointer()
            name, arg = "llvm.prefetch.p0i8", builder.bitcast(ptr, i8p)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [arg.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        builder.call(fn, [arg, i32(_FOR_WRITE), i32(_LOCALITY_HIGH), i32(_DATA_CACHE)])
        return context.get_dummy_value()

    return sig, codegen
