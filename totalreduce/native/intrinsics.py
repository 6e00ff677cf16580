"""Intrinsics: what Numba's nopython mode lacks for a data plane, written in LLVM IR.

- ``ld_<t>(addr)`` / ``st_<t>(addr, value)``: a fixed-width value at any byte address
  (no alignment assumed), for frames and tables in raw memory;
- ``atomic_*``: sequentially consistent atomic loads, stores, compare-and-swap, add and
  exchange on 32- and 64-bit words at an address: the words that threads (and, in
  shared memory, processes) read and write concurrently;
- ``ptr_<t>(addr)``: a typed pointer, for ``numba.carray(ptr_<t>(addr), n)`` views of
  raw memory;
- ``ccall_i32`` / ``ccall_i64`` / ``ccall_void(fn, (args...))``: call the C function at
  address ``fn`` with the arguments of the tuple, each passed as its Numba type says
  (``int32`` as a C ``int``, ``int64`` as a 64-bit integer or pointer, ``float64`` as
  a ``double``).  This is how compiled code calls functions found at run time (the
  MPI library mpi4py loaded), without baking their addresses into cached code;
- ``cpu_relax()``: the spin-wait hint (``pause`` on x86-64, ``yield`` on AArch64).

Addresses are ``int64``.  Everything here is an ``@intrinsic``: it inlines into the
calling compiled function and costs what the one instruction costs.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_MACHINE = platform.machine().lower()

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _pointer(builder: ir.IRBuilder, addr: ir.Value, llty: ir.Type) -> ir.Value:
    return builder.inttoptr(addr, llty.as_pointer())


def _make_load(nbty: types.Type):
    @intrinsic
    def load(typingctx, addr):
        sig = nbty(types.int64)

        def codegen(context, builder, signature, args):
            llty = context.get_value_type(nbty)
            ptr = _pointer(builder, args[0], llty)
            return builder.load(ptr, align=1)

        return sig, codegen

    return load


def _make_store(nbty: types.Type):
    @intrinsic
    def store(typingctx, addr, value):
        sig = types.void(types.int64, nbty)

        def codegen(context, builder, signature, args):
            llty = context.get_value_type(nbty)
            val = context.cast(builder, args[1], signature.args[1], nbty)
            builder.store(val, _pointer(builder, args[0], llty), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return store


ld_i8 = _make_load(types.int8)
ld_u8 = _make_load(types.uint8)
ld_i16 = _make_load(types.int16)
ld_u16 = _make_load(types.uint16)
ld_i32 = _make_load(types.int32)
ld_u32 = _make_load(types.uint32)
ld_i64 = _make_load(types.int64)
ld_u64 = _make_load(types.uint64)
ld_f32 = _make_load(types.float32)
ld_f64 = _make_load(types.float64)
st_i8 = _make_store(types.int8)
st_u8 = _make_store(types.uint8)
st_i16 = _make_store(types.int16)
st_u16 = _make_store(types.uint16)
st_i32 = _make_store(types.int32)
st_u32 = _make_store(types.uint32)
st_i64 = _make_store(types.int64)
st_u64 = _make_store(types.uint64)
st_f32 = _make_store(types.float32)
st_f64 = _make_store(types.float64)


# ---------------------------------------------------------------------------- atomics


def _atomic_ops(nbty: types.Type, llty: ir.Type, width: int):
    align = width // 8

    @intrinsic
    def atomic_load(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.load_atomic(_pointer(builder, args[0], llty), "seq_cst", align)

        return nbty(types.int64), codegen

    @intrinsic
    def atomic_store(typingctx, addr, value):
        def codegen(context, builder, signature, args):
            val = context.cast(builder, args[1], signature.args[1], nbty)
            builder.store_atomic(val, _pointer(builder, args[0], llty), "seq_cst", align)
            return context.get_dummy_value()

        return types.void(types.int64, nbty), codegen

    @intrinsic
    def atomic_cas(typingctx, addr, expected, new):
        """Store ``new`` if the word holds ``expected``; returns what it held."""

        def codegen(context, builder, signature, args):
            exp = context.cast(builder, args[1], signature.args[1], nbty)
            new_ = context.cast(builder, args[2], signature.args[2], nbty)
            ptr = _pointer(builder, args[0], llty)
            res = builder.cmpxchg(ptr, exp, new_, "seq_cst", "seq_cst")
            return builder.extract_value(res, 0)

        return nbty(types.int64, nbty, nbty), codegen

    @intrinsic
    def atomic_add(typingctx, addr, value):
        """Add ``value``; returns the value before."""

        def codegen(context, builder, signature, args):
            val = context.cast(builder, args[1], signature.args[1], nbty)
            return builder.atomic_rmw("add", _pointer(builder, args[0], llty), val, "seq_cst")

        return nbty(types.int64, nbty), codegen

    @intrinsic
    def atomic_xchg(typingctx, addr, value):
        """Store ``value``; returns the value before."""

        def codegen(context, builder, signature, args):
            val = context.cast(builder, args[1], signature.args[1], nbty)
            return builder.atomic_rmw("xchg", _pointer(builder, args[0], llty), val, "seq_cst")

        return nbty(types.int64, nbty), codegen

    return atomic_load, atomic_store, atomic_cas, atomic_add, atomic_xchg


(atomic_load_i64, atomic_store_i64, atomic_cas_i64, atomic_add_i64, atomic_xchg_i64) = _atomic_ops(
    types.int64, _I64, 64
)
(atomic_load_i32, atomic_store_i32, atomic_cas_i32, atomic_add_i32, atomic_xchg_i32) = _atomic_ops(
    types.int32, _I32, 32
)


@intrinsic
def fence(typingctx):
    """A full memory barrier."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cpu_relax(typingctx):
    """Tell the core this is a spin-wait (cheaper for the sibling hyperthread)."""

    def codegen(context, builder, signature, args):
        # LLVM's target intrinsics: the JIT takes no inline assembly.
        if _MACHINE in ("x86_64", "amd64", "i686", "i386"):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        elif _MACHINE in ("aarch64", "arm64"):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [_I32]), "llvm.aarch64.hint"
            )
            builder.call(fn, [ir.Constant(_I32, 1)])  # YIELD
        return context.get_dummy_value()

    return types.void(), codegen


# ---------------------------------------------------------------------------- pointers


def _make_ptr(nbty: types.Type):
    @intrinsic
    def ptr(typingctx, addr):
        sig = types.CPointer(nbty)(types.int64)

        def codegen(context, builder, signature, args):
            # the type in memory (a bool is a byte there, i1 only in registers)
            return _pointer(builder, args[0], context.get_data_type(nbty))

        return sig, codegen

    return ptr


ptr_u8 = _make_ptr(types.uint8)
ptr_i8 = _make_ptr(types.int8)
ptr_u16 = _make_ptr(types.uint16)
ptr_i16 = _make_ptr(types.int16)
ptr_i32 = _make_ptr(types.int32)
ptr_u32 = _make_ptr(types.uint32)
ptr_i64 = _make_ptr(types.int64)
ptr_u64 = _make_ptr(types.uint64)
ptr_f32 = _make_ptr(types.float32)
ptr_f64 = _make_ptr(types.float64)
ptr_bool = _make_ptr(types.boolean)


# ---------------------------------------------------------------------------- C calls


def _make_ccall(ret: types.Type | None):
    @intrinsic
    def ccall(typingctx, fn, args):
        if not isinstance(args, types.BaseTuple):
            raise TypeError("ccall: the arguments go in a tuple")
        for t in args:
            if not isinstance(t, (types.Integer, types.Float)):
                raise TypeError(f"ccall: argument of type {t} (ints and floats only)")
        sig = (types.void if ret is None else ret)(types.int64, args)

        def codegen(context, builder, signature, llargs):
            argtys = signature.args[1]
            lltys = [context.get_value_type(t) for t in argtys]
            vals = [builder.extract_value(llargs[1], i) for i in range(len(lltys))]
            llret = ir.VoidType() if ret is None else context.get_value_type(ret)
            fnty = ir.FunctionType(llret, lltys)
            result = builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), vals)
            return context.get_dummy_value() if ret is None else result

        return sig, codegen

    return ccall


ccall_i32 = _make_ccall(types.int32)
ccall_i64 = _make_ccall(types.int64)
ccall_void = _make_ccall(None)
