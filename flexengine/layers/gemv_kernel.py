"""The Triton kernel behind layers/gemv.py (its own module: triton is imported only when a kernel launches, and
Triton's interpreter resolves a helper through the module's globals, not a closure)."""
import triton
import triton.language as tl


@triton.jit
def residual_row(x_ptr, a_ptr, b_ptr, k, K, HAS_A: tl.constexpr, HAS_B: tl.constexpr):
    # x + a + b over columns k in float32, rounded as the residual stream is stored (the model's dtype)
    h = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if HAS_A:
        h += tl.load(a_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if HAS_B:
        h += tl.load(b_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return h.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def weight_tile(w_ptr, row0, n, k, N, K):
    # rows row0 + n (of the N this program's half holds), columns k
    return tl.load(w_ptr + (row0 + n[:, None]) * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)


@triton.jit
def weight_tile_or_prefetched(w_ptr, row0, n, k, N, K, k0, BLOCK_K: tl.constexpr, first, second,
                              PREFETCH: tl.constexpr):
    # the tile at column k0: one of the PREFETCH tiles read before the PDL wait, else read now
    if PREFETCH == 0:
        w = weight_tile(w_ptr, row0, n, k, N, K)
    elif PREFETCH == 1:
        if k0 == 0:
            w = first
        else:
            w = weight_tile(w_ptr, row0, n, k, N, K)
    else:
        if k0 == 0:
            w = first
        elif k0 == BLOCK_K:
            w = second
        else:
            w = weight_tile(w_ptr, row0, n, k, N, K)
    return w


@triton.jit
def rope_rows(pid, HALF: tl.constexpr):
    # ROPE: program pid takes rotary pairs 2 pid and 2 pid + 1 of one head (HALF even: both in the same head), the
    # rows (j, j + HALF) of each: [j0, j0 + HALF, j1, j1 + HALF] → (rows, the head, the pairs' j)
    h = (pid * 2) // HALF
    j = (pid * 2) % HALF + tl.arange(0, 2)
    n = tl.reshape(h * 2 * HALF + j[:, None] + (tl.arange(0, 2) * HALF)[None, :], [4])
    return n, h, j


@triton.jit
def rope_epilogue(y, h, j, n, cos_ptr, sin_ptr, slot_ptr, out_ptr, kc_ptr, vc_ptr, dtype,
                  Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr):
    # y [4]: the q/k/v rows of rope_rows, rounded to the model's dtype. q and k rotated (x1 cos - x2 sin,
    # x2 cos + x1 sin in float32, rounded once, as Inductor's rotary kernel); q into out, k and v into the caches at
    # the token's slot (contiguous [pages, page size, KV heads, D]: slot * KV_HEADS * D + the row in k or v)
    x1, x2 = tl.split(tl.reshape(y, [2, 2]))
    c = tl.load(cos_ptr + j).to(tl.float32)
    s = tl.load(sin_ptr + j).to(tl.float32)
    rotate = h < Q_HEADS + KV_HEADS
    o1 = tl.where(rotate, x1 * c - x2 * s, x1)
    o2 = tl.where(rotate, x2 * c + x1 * s, x2)
    o = tl.reshape(tl.join(o1, o2), [4]).to(dtype)
    q_rows = Q_HEADS * 2 * HALF
    kv_rows = KV_HEADS * 2 * HALF
    slot = tl.load(slot_ptr)
    tl.store(out_ptr + n, o.to(out_ptr.dtype.element_ty), mask=n < q_rows)
    tl.store(kc_ptr + slot * kv_rows + (n - q_rows), o, mask=(n >= q_rows) & (n < q_rows + kv_rows))
    tl.store(vc_ptr + slot * kv_rows + (n - q_rows - kv_rows), o, mask=n >= q_rows + kv_rows)


@triton.jit
def gemv_kernel(x_ptr, a_ptr, b_ptr, nw_ptr, w_ptr, out_ptr, sum_ptr, N, K, eps,
                cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
                PROLOGUE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, WRITE_SUM: tl.constexpr,
                GATED: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROPE: tl.constexpr = False, Q_HEADS: tl.constexpr = 0,
                KV_HEADS: tl.constexpr = 0, HALF: tl.constexpr = 0):
    # PROLOGUE 0: the input is x; 1: rmsnorm(x + a + b) * nw.
    # GATED: w is [2N, K] = [gate; up], and the output silu(w[:N] @ x) * (w[N:] @ x): a program takes the
    # same rows of both halves, so the activation is an epilogue (no second read of anything)
    # ROPE (BLOCK_N 4): w is q/k/v's [(Q_HEADS + 2 KV_HEADS) * 2 HALF, K]; a program takes two rotary pairs' rows
    # (rope_rows), so rotary and the K/V cache store are an epilogue (rope_epilogue), and only q comes out
    # USE_PDL: launched while the kernel before drains; its writes are visible only after gdc_wait. PREFETCH (0-2,
    # with USE_PDL): that many weight tiles are loaded before that wait (no kernel writes the weights), so the read
    # starts while the kernel before finishes
    pid = tl.program_id(0)
    if ROPE:
        n, head, pair_j = rope_rows(pid, HALF)
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_first, w_second, u_first, u_second = 0.0, 0.0, 0.0, 0.0  # placeholders for the tiles PREFETCH does not read
    if PREFETCH >= 1:
        k = tl.arange(0, BLOCK_K)
        w_first = weight_tile(w_ptr, 0, n, k, N, K)
        if GATED:
            u_first = weight_tile(w_ptr, N, n, k, N, K)
    if PREFETCH >= 2:
        k = BLOCK_K + tl.arange(0, BLOCK_K)
        w_second = weight_tile(w_ptr, 0, n, k, N, K)
        if GATED:
            u_second = weight_tile(w_ptr, N, n, k, N, K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    dtype = x_ptr.dtype.element_ty  # the model's: every rounding is to it (a float32 output holds its values)
    inv = 0.0
    if PROLOGUE == 1:
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h = residual_row(x_ptr, a_ptr, b_ptr, k, K, HAS_A, HAS_B)
            if WRITE_SUM:
                if pid == 0:
                    tl.store(sum_ptr + k, h.to(dtype), mask=k < K)
            sq += h * h
        inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if PROLOGUE == 1:
            h = residual_row(x_ptr, a_ptr, b_ptr, k, K, HAS_A, HAS_B)
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            x = ((h * inv).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)  # RMSNorm's roundings
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += tl.sum(x[None, :] * weight_tile_or_prefetched(w_ptr, 0, n, k, N, K, k0, BLOCK_K, w_first, w_second,
                                                             PREFETCH).to(tl.float32), axis=1)
        if GATED:
            acc_up += tl.sum(x[None, :] * weight_tile_or_prefetched(w_ptr, N, n, k, N, K, k0, BLOCK_K, u_first,
                                                                    u_second, PREFETCH).to(tl.float32), axis=1)
    if USE_PDL:  # the next kernel may start (it waits for this one's writes itself)
        tl.extra.cuda.gdc_launch_dependents()
    if GATED:  # the projections rounded as cuBLAS's output is, then silu(g) * u rounded once, as Inductor's kernel
        g = acc.to(dtype).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * acc_up.to(dtype).to(tl.float32)
    if ROPE:
        rope_epilogue(acc.to(dtype).to(tl.float32), head, pair_j, n, cos_ptr, sin_ptr, slot_ptr, out_ptr, kc_ptr,
                      vc_ptr, dtype, Q_HEADS, KV_HEADS, HALF)
    else:
        tl.store(out_ptr + n, acc.to(dtype).to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def rows_kernel(x_ptr, w_ptr, out_ptr, M, N, K, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
                M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    # out[M, N] = x[M, K] @ w[N, K]^T for a few rows (gemv.FEW_ROWS): a program reads BLOCK_N rows of the weight
    # once for every row of x (padded to M_PAD for the tensor cores); PDL and PREFETCH (0 or 1) as gemv_kernel's.
    # GATED: w is [gate; up], 2N rows, and out[M, N] = silu(x @ gate^T) * (x @ up^T), rounded as gemv_kernel's
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    w_first = 0.0  # a placeholder where PREFETCH reads nothing
    u_first = 0.0
    if PREFETCH >= 1:
        w_first = weight_tile(w_ptr, 0, n, tl.arange(0, BLOCK_K), N, K)
        if GATED:
            u_first = weight_tile(w_ptr, N, n, tl.arange(0, BLOCK_K), N, K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = weight_tile_or_prefetched(w_ptr, 0, n, k, N, K, k0, BLOCK_K, w_first, 0.0, PREFETCH)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            u = weight_tile_or_prefetched(w_ptr, N, n, k, N, K, k0, BLOCK_K, u_first, 0.0, PREFETCH)
            acc_up = tl.dot(x, tl.trans(u), acc_up)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)  # rounded to the model's dtype, as cuBLAS's
    if GATED:
        out = out / (1.0 + tl.exp(-out)) * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + m[:, None] * N + n[None, :], out.to(dtype).to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    # out[t, :N] = silu(x[t, :N]) * x[t, N:2N] (the MLP's SiLU-and-mul after cuBLAS's gate/up), in float32 from
    # the model's dtype and rounded once, as Inductor's kernel: program (t, b) takes BLOCK columns of token t
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(x_ptr + t * 2 * N + n, mask=n < N, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * 2 * N + N + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + n, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=n < N)
