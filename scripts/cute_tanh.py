"""tanh forms for flex's FA4 code generator, which scripts/softcap_probe.py writes into the kernels by name (the kernel
imports this module: the probe's folder is on the path). Needs FA4's CuTe DSL."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@cute.jit
def tanh_approx(x):
    """tanh by the GPU's one-instruction approximation (PTX tanh.approx.f32: one special-function op per
    element, max relative error 2^-10.987 by the PTX ISA), element by element: the intrinsic takes scalars
    and a score mod gets a vector of scores."""
    if cutlass.const_expr(isinstance(x, cute.TensorSSA)):
        frag = cute.make_rmem_tensor(x.shape, x.dtype)
        frag.store(x)
        for i in cutlass.range(cute.size(frag), unroll_full=True):
            frag[i] = cute.math.tanh(frag[i], approx=True)
        return frag.load()
    return cute.math.tanh(x, approx=True)


@dsl_user_op
def tanh_pair(a: Float32, b: Float32, *, loc=None, ip=None):
    """tanh of two floats in one special-function op: both rounded to half precision, PTX tanh.approx.f16x2,
    widened back."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 p;\n\t.reg .f16 lo, hi;\n\t"
        "cvt.rn.f16x2.f32 p, $3, $2;\n\t"  # a to the low half, b to the high
        "tanh.approx.f16x2 p, p;\n\t"
        "mov.b32 {lo, hi}, p;\n\t"
        "cvt.f32.f16 $0, lo;\n\t"
        "cvt.f32.f16 $1, hi;\n\t}\n",
        "=f,=f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return (Float32(llvm.extractvalue(T.f32(), out, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), out, [1], loc=loc, ip=ip)))


@cute.jit
def tanh_f16x2(x):
    """tanh of a score vector two elements per special-function op (tanh_pair)."""
    frag = cute.make_rmem_tensor(x.shape, x.dtype)
    frag.store(x)
    n = cute.size(frag)
    for i in cutlass.range_constexpr(0, n - 1, 2):
        lo, hi = tanh_pair(frag[i], frag[i + 1])
        frag[i] = lo
        frag[i + 1] = hi
    if cutlass.const_expr(n % 2 == 1):
        frag[n - 1] = cute.math.tanh(frag[n - 1], approx=True)
    return frag.load()
