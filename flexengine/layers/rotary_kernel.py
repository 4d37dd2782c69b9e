"""The Triton kernel behind rotary.rotary_store (its own module: triton is imported only when it launches)."""
import triton
import triton.language as tl


@triton.jit
def rotary_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, qkv_stride, cs_stride,
                        Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                        HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, KV_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    # program t takes token t's row of the q/k/v projection [(Q_HEADS + 2 KV_HEADS) * 2 HALF]: q's and k's heads
    # rotated (neox pairs (j, j + HALF): x1 cos - x2 sin, x2 cos + x1 sin in float32, rounded once, as Inductor's
    # rotary kernel), q into out [T, Q_HEADS, 2 HALF], k and v into the caches at the token's slot (contiguous
    # [pages, page size, KV_HEADS, 2 HALF]: slot * KV_HEADS * 2 HALF + the row in k or v)
    t = tl.program_id(0)
    if USE_PDL:  # the projection before is cuBLAS's: it does not trigger early, but the launch itself overlaps
        tl.extra.cuda.gdc_wait()
    D: tl.constexpr = 2 * HALF
    h = tl.arange(0, HEADS_PAD)[:, None]  # q's heads, then k's
    j = tl.arange(0, HALF_PAD)[None, :]
    row = qkv_ptr + t.to(tl.int64) * qkv_stride
    live = (h < Q_HEADS + KV_HEADS) & (j < HALF)
    x1 = tl.load(row + h * D + j, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(row + h * D + HALF + j, mask=live, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * cs_stride + j, mask=j < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * cs_stride + j, mask=j < HALF, other=0.0).to(tl.float32)
    kv = tl.arange(0, KV_PAD)  # v's KV_HEADS * D values, copied as they are
    v = tl.load(row + (Q_HEADS + KV_HEADS) * D + kv, mask=kv < KV_HEADS * D)
    if USE_PDL:  # the attention kernel after may launch (it waits for these stores itself)
        tl.extra.cuda.gdc_launch_dependents()
    dtype = q_ptr.dtype.element_ty
    o1 = (x1 * c - x2 * s).to(dtype)
    o2 = (x2 * c + x1 * s).to(dtype)
    is_q = h < Q_HEADS
    tl.store(q_ptr + t.to(tl.int64) * (Q_HEADS * D) + h * D + j, o1, mask=live & is_q)
    tl.store(q_ptr + t.to(tl.int64) * (Q_HEADS * D) + h * D + HALF + j, o2, mask=live & is_q)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k_row = kc_ptr + slot * (KV_HEADS * D) + (h - Q_HEADS) * D
    tl.store(k_row + j, o1, mask=live & ~is_q)
    tl.store(k_row + HALF + j, o2, mask=live & ~is_q)
    tl.store(vc_ptr + slot * (KV_HEADS * D) + kv, v, mask=kv < KV_HEADS * D)
