"""Math that flex's FA4 code generator calls by name in the kernels it writes (prefill_kernel.use_fast_tanh).
Imported only there, where FA4 and its CuTe DSL are installed."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


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
