"""The Triton kernel behind rotary.rotary_store (its own module: triton is imported only when it launches)."""
import triton
import triton.language as tl


@triton.jit
def rotary_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, qkv_stride, cs_stride,
                        Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                        HEADS_BLOCK: tl.constexpr, HALF_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    # program (t, g) takes heads g * HEADS_BLOCK... of token t's row of the q/k/v projection, q's heads, then k's,
    # then v's [(Q_HEADS + 2 KV_HEADS) * 2 HALF]: q's and k's rotated (neox pairs (j, j + HALF): x1 cos - x2 sin,
    # x2 cos + x1 sin in float32, rounded once, as Inductor's rotary kernel), v's as they are; q into out
    # [T, Q_HEADS, 2 HALF], k and v into the caches at the token's slot (contiguous [pages, page size, KV_HEADS,
    # 2 HALF]: slot * KV_HEADS * 2 HALF + the head's row)
    t = tl.program_id(0)
    if USE_PDL:  # the projection before is cuBLAS's: it does not trigger early, but the launch itself overlaps
        tl.extra.cuda.gdc_wait()
    D: tl.constexpr = 2 * HALF
    h = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    row = qkv_ptr + t.to(tl.int64) * qkv_stride + h * D + j
    live = (h < Q_HEADS + 2 * KV_HEADS) & (j < HALF)
    x1 = tl.load(row, mask=live, other=0.0)
    x2 = tl.load(row + HALF, mask=live, other=0.0)
    c = tl.load(cos_ptr + t * cs_stride + j, mask=j < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * cs_stride + j, mask=j < HALF, other=0.0).to(tl.float32)
    if USE_PDL:  # the attention kernel after may launch (it waits for these stores itself)
        tl.extra.cuda.gdc_launch_dependents()
    rotate = h < Q_HEADS + KV_HEADS
    o1 = tl.where(rotate, x1.to(tl.float32) * c - x2.to(tl.float32) * s, x1.to(tl.float32)).to(x1.dtype)
    o2 = tl.where(rotate, x2.to(tl.float32) * c + x1.to(tl.float32) * s, x2.to(tl.float32)).to(x1.dtype)
    is_q, is_k = h < Q_HEADS, (h >= Q_HEADS) & rotate
    q_row = q_ptr + t.to(tl.int64) * (Q_HEADS * D) + h * D + j
    tl.store(q_row, o1, mask=live & is_q)
    tl.store(q_row + HALF, o2, mask=live & is_q)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # the engine pads with its scratch page's slot, never a negative one; a stray -1 writes nothing
        k_row = kc_ptr + slot * (KV_HEADS * D) + (h - Q_HEADS) * D + j
        tl.store(k_row, o1, mask=live & is_k)
        tl.store(k_row + HALF, o2, mask=live & is_k)
        v_row = vc_ptr + slot * (KV_HEADS * D) + (h - Q_HEADS - KV_HEADS) * D + j
        tl.store(v_row, o1, mask=live & ~rotate)
        tl.store(v_row + HALF, o2, mask=live & ~rotate)


# One compile per engine: no integer argument, and the positions (a view at any offset in the eager steps' packed
# copy) not specialised on their alignment, which would compile a second kernel at the first odd offset
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def cos_sin_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # program t: angle = float32(position t) * inv_freq[j], its cos and sin rounded to the outputs' dtype once, as
    # Inductor's kernel for rotary.cos_sin's code computes them (tl.cos and tl.sin are its own). A token a program:
    # a decode step's one token computes no masked rows
    if USE_PDL:  # the positions are written by the kernel before (the decode graphs' inputs)
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    j = tl.arange(0, HALF_PAD)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = t.to(tl.int64) * HALF + j
    tl.store(cos_ptr + out, tl.cos(angle).to(cos_ptr.dtype.element_ty), mask=j < HALF)
    tl.store(sin_ptr + out, tl.sin(angle).to(sin_ptr.dtype.element_ty), mask=j < HALF)
