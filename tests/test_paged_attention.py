"""paged_attention against the plain dense reference, over drawn layouts, lengths and mods."""
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_reference import PLAIN_MASKS, as_plain, dense_paged_attention, make_paged_batch
from harness import fa4_reason, flex_prefill
from flexengine import masks
from flexengine.attention import paged_attention
from flexengine.attention.backends import default_flex
from flexengine.attention.backends import flex_kernels


@masks.register_mask_mod("test_stripes", replace=True)
def stripes(b, h, q_idx, kv_idx):
    # head-dependent: even heads are causal, odd heads also skip every third key
    return (kv_idx <= q_idx) & ((h % 2 == 0) | ((q_idx - kv_idx) % 3 != 1))


def sink_window(b, h, q_idx, kv_idx):  # a plain callable, never registered
    return (kv_idx <= q_idx) & ((kv_idx < 2) | (q_idx - kv_idx < 5))


@st.composite
def mask_cases(draw, block_size):
    kind = draw(st.sampled_from(["causal", "bidirectional", "sliding", "chunked", "prefix", "registered", "callable"]))
    if kind in ("causal", "bidirectional"):
        return kind, PLAIN_MASKS[kind]
    if kind == "sliding":
        # windows smaller and larger than a page
        w = draw(st.sampled_from([1, 3, block_size - 1, block_size, block_size + 5, 3 * block_size]))
        return masks.sliding_window(w), PLAIN_MASKS["sliding_window"](w)
    if kind == "chunked":
        c = draw(st.sampled_from([4, block_size, 2 * block_size]))
        return masks.chunked_local(c), PLAIN_MASKS["chunked_local"](c)
    if kind == "prefix":
        p = draw(st.integers(0, 40))
        return masks.prefix_lm(p), PLAIN_MASKS["prefix_lm"](p)
    if kind == "registered":
        return "test_stripes", as_plain(stripes)
    return sink_window, as_plain(sink_window)


@st.composite
def score_cases(draw, Hq):
    kind = draw(st.sampled_from([None, "softcap", "alibi"]))
    if kind is None:
        return None, None
    if kind == "softcap":
        c = draw(st.sampled_from([0.5, 2.0, 30.0]))
        return masks.softcap(c), (lambda s, b, h, q, kv: c * float(torch.tanh(torch.tensor(s / c, dtype=torch.float64))))
    slopes = [2.0 ** (-(i + 1)) for i in range(Hq)]
    return masks.alibi(slopes), (lambda s, b, h, q, kv: s + slopes[h] * (kv - q))


@st.composite
def batches(draw, max_len=90, decode_only=False):
    block_size = draw(st.sampled_from([16, 32, 64, 128]))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.integers(1, 4))
    D = draw(st.sampled_from([16, 32, 72, 80, 128]))
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        kind = "decode" if decode_only else draw(st.sampled_from(["decode", "prefill", "chunk"]))
        L = draw(st.integers(1, max_len))
        n = {"decode": 1, "prefill": L, "chunk": draw(st.integers(1, L))}[kind]
        reqs.append((L, n))
    mask = draw(mask_cases(block_size))
    score = draw(score_cases(Hq))
    seed = draw(st.integers(0, 2**16))
    return block_size, Hq, Hkv, D, reqs, mask, score, seed


def run_case(case, backend, dtype=torch.float32, device="cpu"):
    block_size, Hq, Hkv, D, reqs, (mask, plain_mask), (score, plain_score), seed = case
    seq_lens, query_lens = [L for L, _ in reqs], [n for _, n in reqs]
    q, kc, vc, tables = make_paged_batch(random.Random(seed), seq_lens, query_lens, block_size, Hq, Hkv, D,
                                         dtype=dtype, device=device)
    out = paged_attention(q, kc, vc, torch.tensor(tables, dtype=torch.int32, device=device),
                          torch.tensor(seq_lens, dtype=torch.int32, device=device),
                          torch.tensor(query_lens, dtype=torch.int32, device=device),
                          mask_mod=mask, score_mod=score, backend=backend)
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, plain_mask, plain_score)
    return out.double().cpu(), ref


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_flex_matches_dense_reference(case):
    out, ref = run_case(case, "flex")
    torch.testing.assert_close(out, ref, atol=3e-4, rtol=3e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_len=50))
def test_reference_backend_matches_dense_reference(case):
    out, ref = run_case(case, "reference")
    torch.testing.assert_close(out, ref, atol=3e-4, rtol=3e-4)


def test_compiled_flex_on_cpu_honours_block_lists():
    """Eager flex evaluates mask_mod over the whole pool; the compiled kernel reads only the listed
    pages, so this is the run where a wrong page list would show."""
    from flexengine.attention.backends import flex as flex_backend
    rng = random.Random(7)
    seq_lens, query_lens = [70, 33, 5], [1, 33, 2]
    q, kc, vc, tables = make_paged_batch(rng, seq_lens, query_lens, 16, 4, 2, 16)
    window = masks.sliding_window(20)
    backend = flex_backend.FlexBackend(compile=True)
    from flexengine.attention.metadata import build_metadata
    from flexengine.attention.layout import plan_layout
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), plan_layout(query_lens, seq_lens, block_size=16), 16, kc.shape[0])
    meta.backend = backend
    out = backend.forward(q, kc, vc, meta, window, None, 0.25)
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, PLAIN_MASKS["sliding_window"](20), scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-4, rtol=3e-4)


def test_compiled_flex_reads_128_token_pages_in_place():
    """Pages of KV_TILE tokens: the compiled prefill reads the pool in place (no workspace copy). Tile 0 holds
    three requests, two of which share a page of a cached prefix, and a decode row between them."""
    import math
    from flexengine.attention.backends import flex as flex_backend
    from flexengine.attention.layout import plan_layout
    from flexengine.attention.metadata import build_metadata
    P, Hq, Hkv, D = 128, 4, 2, 16
    seq_lens, query_lens = [300, 200, 90, 140], [20, 10, 1, 140]
    tables = [[5, 2, 9], [5, 7, 1], [3, 4, 4], [0, 11, 6]]  # request 1 shares request 0's first page
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(12, P, Hkv, D, generator=g), torch.randn(12, P, Hkv, D, generator=g)
    q = torch.randn(sum(query_lens), Hq, D, generator=g)
    backend = flex_backend.FlexBackend(compile=True)
    assert backend.direct(P, q.device)
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), plan_layout(query_lens, seq_lens, block_size=P), P, 12)
    meta.backend = backend
    out = backend.forward(q, kc, vc, meta, masks.causal, masks.softcap(2.0), 0.25)
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, PLAIN_MASKS["causal"],
                                lambda s, b, h, qq, kv: 2.0 * math.tanh(s / 2.0), scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-4, rtol=3e-4)


def engine_prefill(backend, kc, vc, reqs, mods, seed):
    """(the engine backend's output, the reference backend's) for one step of `reqs` (new tokens, cached tokens)
    over the pool kc/vc of 128-token pages, its pages drawn at random."""
    from flexengine.attention.backends.reference import ReferenceBackend
    from flexengine.attention.layout import plan_layout
    from flexengine.attention.metadata import build_metadata
    NB, P, Hkv, D = kc.shape
    rng = random.Random(seed)
    seq_lens, query_lens = [n + c for n, c in reqs], [n for n, _ in reqs]
    need = [-(-L // P) for L in seq_lens]
    pages = rng.sample(range(NB), sum(need))
    # (as wide as the pool: an engine's tables keep one width)
    tables = [pages[sum(need[:i]):sum(need[:i + 1])] + [0] * (NB - need[i]) for i in range(len(reqs))]
    q = torch.randn(sum(query_lens), 2 * Hkv, D, generator=torch.Generator().manual_seed(seed)).to(kc)
    outs = []
    for impl in (backend, ReferenceBackend()):
        meta = build_metadata(torch.tensor(tables, dtype=torch.int32, device=kc.device),
                              torch.tensor(seq_lens, dtype=torch.int32, device=kc.device),
                              torch.empty(0, dtype=torch.long, device=kc.device),
                              plan_layout(query_lens, seq_lens, block_size=P), P, NB)
        meta.backend = impl
        impl.prepare(meta, [mods])
        outs.append(impl.forward(q, kc, vc, meta, *mods, D ** -0.5).float())
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_prefill_compiles_once_for_the_buckets_past_the_first_on_gpu(monkeypatch):
    """An engine's Triton prefill call (flex_kernels.PREFILL_DYNAMIC) over steps of 1, 2, 3, 5 and 9 tiles: the first
    compile specialises one tile, the next makes the tile count symbolic and serves the rest (a compile per bucket
    cost a fresh start 48 of its 145 s on the H200); every step's output equal to the reference backend's."""
    from flexengine.attention.backends import flex as flex_backend
    from flexengine.compile.policy import compile_count
    monkeypatch.setattr(flex_kernels, "PREFILL_DYNAMIC", True)
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(40, 128, 2, 64, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(40, 128, 2, 64, generator=g).to("cuda", torch.bfloat16)
    with flex_prefill("triton"):
        backend = flex_backend.FlexBackend()
        backend.reserve_workspace(40, 128, 2, 64, torch.bfloat16, "cuda")  # (what makes it an engine's backend)
        before = compile_count()
        for reqs in ([(60, 0), (40, 100)], [(150, 0), (90, 30)], [(200, 130), (170, 0)], [(400, 200), (230, 0)],
                     [(900, 0), (200, 700)]):
            out, ref = engine_prefill(backend, kc, vc, reqs, (masks.causal, None), reqs[0][0])
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert compile_count() - before <= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(2, 1100), st.integers(0, 700)), min_size=1, max_size=5),
       st.sampled_from(["causal", "window", "chunked", "document"]), st.booleans(), st.integers(0, 2**16))
def test_engine_prefill_with_symbolic_tiles_on_gpu(reqs, mask, softcap, seed):
    """An engine's Triton prefill call (flex_kernels.PREFILL_DYNAMIC: one compile whose tile count is symbolic serves
    every bucket past the first two) over drawn layouts on one pool, with built-in and captured-tensor masks and a
    softcap, against the reference backend."""
    symbolic_engine_step({"PREFILL_DYNAMIC": True}, reqs, mask, softcap, seed, pages=96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([1, 1, 1, 1, 1, 1, 37, 200]), st.integers(0, 380)), min_size=2, max_size=40),
       st.sampled_from(["causal", "window", "chunked", "document"]), st.booleans(), st.integers(0, 2**16))
def test_engine_decode_with_symbolic_rows_on_gpu(reqs, mask, softcap, seed):
    """An engine's unsplit decode rows with query heads as rows at every row count, flex_kernels.DECODE_DYNAMIC (one
    compile whose row count is symbolic serves every row count past the first two), in decode-only and mixed steps
    over drawn layouts on one pool, with built-in and captured-tensor masks and a softcap, against the reference
    backend."""
    symbolic_engine_step({"DECODE_DYNAMIC": True}, reqs, mask, softcap, seed, pages=160)


def symbolic_engine_step(flags: dict, reqs, mask: str, softcap: bool, seed: int, pages: int):
    """engine_prefill on CUDA over a pool of `pages` 128-token pages for an engine's backend (reserve_workspace)
    with flex_kernels' `flags` set, against the reference backend."""
    from flexengine.attention.backends import flex as flex_backend
    mask_mod = {"causal": masks.causal, "window": masks.sliding_window(300), "chunked": masks.chunked_local(256),
                "document": document_mask(4096, 301)[0]}[mask]
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(pages, 128, 2, 64, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(pages, 128, 2, 64, generator=g).to("cuda", torch.bfloat16)
    with flex_prefill("triton"), pytest.MonkeyPatch.context() as env:
        for name, value in flags.items():
            env.setattr(flex_kernels, name, value)
        backend = flex_backend.FlexBackend()
        backend.reserve_workspace(pages, 128, 2, 64, torch.bfloat16, "cuda")
        out, ref = engine_prefill(backend, kc, vc, reqs, (mask_mod, masks.softcap(20.0) if softcap else None), seed)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("q_len, kv_len, blocks, divisible", [
    (128, 4096, (128, 128), True), (1024, 4096, (128, 128), True),
    (192, 4096, (128, 128), False),  # a partial q tile
    (256, 4000, (128, 128), False),  # a KV length that is not whole blocks (a pool of 16-token pages, say)
    (256, 4096, (128, 1024), True), (256, 4608, (128, 1024), False),  # whole 128s, not whole KV blocks
    (128, 128, (128, 4096), True),  # one block longer than the KV: divisible, as Inductor reads it
])
def test_whole_blocks_is_inductors_divisibility(q_len, kv_len, blocks, divisible):
    """flex_kernels.whole_blocks, the IS_DIVISIBLE passed to the symbolic prefill compile, holds exactly where
    Inductor's own static-shape test would (lengths multiples of 128 and of the mask's blocks, or one block covering
    all): a wrong True would drop the template's bounds checks on a partial tile."""
    from types import SimpleNamespace
    q, k = torch.empty(1, 1, q_len, 8), torch.empty(1, 1, kv_len, 8)
    assert flex_kernels.whole_blocks(q, k, SimpleNamespace(BLOCK_SIZE=blocks)) is divisible


def test_memory_stand_in_compiles_nothing():
    """The KV sizing's profiling step (kv_sizing.profile_kv_budget) runs flex's calls as memory stand-ins: no
    compile for the scratch cache's shape, an output of the kernel's shape and strides (the layers after attention
    compile for them); the real kernel again afterwards."""
    from flexengine.attention.backends import flex as flex_backend
    from flexengine.attention.layout import plan_layout
    from flexengine.attention.metadata import build_metadata
    from flexengine.compile.policy import compile_count
    P, seq_lens, query_lens = 128, [300, 140], [20, 140]
    q, kc, vc, tables = make_paged_batch(random.Random(5), seq_lens, query_lens, P, 4, 2, 16)
    backend = flex_backend.FlexBackend(compile=True)
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), plan_layout(query_lens, seq_lens, block_size=P), P,
                          kc.shape[0])
    meta.backend = backend
    before = compile_count()
    with backend.memory_stand_in():
        out = backend.forward(q, kc, vc, meta, masks.causal, None, 0.25)
    assert compile_count() == before and not backend.stand_in
    real = backend.forward(q, kc, vc, meta, masks.causal, None, 0.25)  # the compiled kernel
    assert (out.shape, out.stride(), out.dtype) == (real.shape, real.stride(), real.dtype)


def test_per_request_parameter():
    rng = random.Random(3)
    seq_lens, query_lens = [30, 30], [30, 1]
    q, kc, vc, tables = make_paged_batch(rng, seq_lens, query_lens, 16, 2, 1, 16)
    args = (q, kc, vc, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens), torch.tensor(query_lens))
    out = paged_attention(*args, mask_mod="prefix_lm", attention_params={"prefix_len": torch.tensor([12, 0])})
    ref0 = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, lambda b, h, qq, kv: kv <= qq or kv < (12, 0)[b])
    torch.testing.assert_close(out.double(), ref0, atol=3e-4, rtol=3e-4)
    with pytest.raises(ValueError, match="prefix_len"):
        paged_attention(*args, mask_mod="prefix_lm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_len=300))
def test_flex_bf16_on_gpu(case):
    """The Triton prefill kernel (FA4, which auto takes where installed, has its own test below: its JIT
    compile of each new shape takes tens of seconds)."""
    with flex_prefill("triton"):
        out, ref = run_case(case, "flex", dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_len=300))
def test_flex_decode_rows_without_full_lists_on_gpu(case):
    """metadata.DECODE_PARTIAL_ROWS: decode rows whose every page is partial (flex's decode template without its
    full-block loop; the CPU never takes it) against the dense reference."""
    from flexengine.attention import metadata
    with pytest.MonkeyPatch.context() as env, flex_prefill("triton"):
        env.setattr(metadata, "DECODE_PARTIAL_ROWS", 64)
        out, ref = run_case(case, "flex", dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(batches(max_len=300, decode_only=True), batches(max_len=300)))
def test_flex_decode_with_heads_as_rows_on_gpu(case):
    """flex_kernels.DECODE_HEADS_AS_ROWS: decode rows (of decode-only and of mixed steps) on flex's attention template,
    each KV head's query heads as its query rows, against the dense reference (head-dependent masks and score mods among
    the drawn ones)."""
    with pytest.MonkeyPatch.context() as env:
        env.setattr(flex_kernels, "DECODE_HEADS_AS_ROWS", 64)
        out, ref = run_case(case, "flex", dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_heads_as_rows_keeps_large_heads_on_the_decode_template(monkeypatch):
    """Heads larger than HEADS_AS_ROWS_MAX_HEAD_DIM (Gemma-2's 256) keep the decode template; the sizes the H100 ran
    take the attention template, in steps of up to DECODE_HEADS_AS_ROWS decode rows."""
    from flexengine.attention.layout import plan_layout
    monkeypatch.setattr(flex_kernels, "HEADS_AS_ROWS_ON_CPU", True)
    monkeypatch.setattr(flex_kernels, "DECODE_HEADS_AS_ROWS", 4)
    small, large = plan_layout([1] * 4, [9] * 4, block_size=16), plan_layout([1] * 5, [9] * 5, block_size=16)
    takes = {D: flex_kernels.takes_heads_as_rows(small, torch.empty(4, 8, D)) for D in (64, 128, 256)}
    assert takes == {64: True, 128: True, 256: False}
    assert not flex_kernels.takes_heads_as_rows(large, torch.empty(5, 8, 64))


@pytest.mark.parametrize("mask, plain, score, plain_score", [
    (stripes, as_plain(stripes), masks.alibi([2.0 ** -(i + 1) for i in range(8)]),
     lambda s, b, h, q, kv: s + 2.0 ** -(h + 1) * (kv - q)),
    (masks.sliding_window(20), PLAIN_MASKS["sliding_window"](20), masks.softcap(2.0),
     lambda s, b, h, q, kv: 2.0 * math.tanh(s / 2.0))])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 33, 1, 4]])
def test_compiled_decode_with_heads_as_rows_on_cpu(mask, plain, score, plain_score, query_lens, monkeypatch):
    """The decode rows' query heads as flex's query rows ([rows, Hkv, G, D], flex_kernels.DECODE_HEADS_AS_ROWS),
    through the CPU's compiled flex, in a decode-only step (the rows in place) and a mixed one: the mods must see each
    row's query head (h * G + the row) and the request's last position."""
    from flexengine.attention.backends import flex as flex_backend
    from flexengine.attention.layout import plan_layout
    from flexengine.attention.metadata import build_metadata
    monkeypatch.setattr(flex_kernels, "DECODE_HEADS_AS_ROWS", 8)
    monkeypatch.setattr(flex_kernels, "HEADS_AS_ROWS_ON_CPU", True)
    seq_lens = [70, 33, 5, 17]
    q, kc, vc, tables = make_paged_batch(random.Random(3), seq_lens, query_lens, 16, 8, 2, 16)
    backend = flex_backend.FlexBackend(compile=True)
    layout = plan_layout(query_lens, seq_lens, block_size=16)
    assert layout.decode_in_place == (max(query_lens) == 1) and flex_kernels.takes_heads_as_rows(layout, q)
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), layout, 16, kc.shape[0])
    meta.backend = backend
    out = backend.forward(q, kc, vc, meta, mask, score, 0.25)
    assert "heads_as_rows" in meta.backend_state  # (the path under test ran)
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, plain, plain_score, scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-4, rtol=3e-4)


def document_mask(max_len=4096, doc_len=37):
    doc = (torch.arange(max_len, device="cuda") // doc_len).int()

    def same_document(b, h, q_idx, kv_idx):  # attention-gym's shape of mod: a captured tensor, indexed
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])
    return same_document, (lambda b, h, q, kv: kv <= q and q // doc_len == kv // doc_len)


@pytest.mark.gpu
@pytest.mark.skipif(fa4_reason() is not None, reason=f"FlashAttention-4 cannot run here: {fa4_reason()}")
@pytest.mark.parametrize("mods, D, block_size, q_tiles", [
    ("causal", 64, 16, 1), ("causal", 128, 128, 1), ("window_softcap", 128, 16, 1), ("document", 64, 128, 3),
    ("causal", 64, 128, 3)])  # each case one FA4 JIT compile
def test_flex_fa4_prefill_on_gpu(mods, D, block_size, q_tiles, caplog):
    """FA4 through flex's FLASH backend, asked for by name: mixed decode/chunk/prefill steps at pages
    of 16 and 128 against the dense reference, with no fallback to Triton; at 128-token pages also in q blocks
    of three tiles (FA4's 192-row tiles at head size 64), of two requests and of one with full pages."""
    if mods == "causal":
        mask, plain, score, plain_score = "causal", PLAIN_MASKS["causal"], None, None
    elif mods == "window_softcap":
        mask, plain = masks.sliding_window(100), PLAIN_MASKS["sliding_window"](100)
        score = masks.softcap(30.0)
        plain_score = lambda s, b, h, q, kv: 30.0 * math.tanh(s / 30.0)  # noqa: E731
    else:
        (mask, plain), score, plain_score = document_mask(), None, None
    # (small enough for the plain Python reference: a 2,000-token case took minutes)
    seq_lens, query_lens = {16: ([400, 1, 300, 129, 200], [1, 1, 45, 129, 100]), 128: ([300, 333], [300, 60])}[block_size]
    if (mods, q_tiles) == ("causal", 3):  # a chunk of 512 over 128 cached: its first q block has a full page
        seq_lens, query_lens = [640], [512]
    rng = random.Random(block_size)
    q, kc, vc, tables = make_paged_batch(rng, seq_lens, query_lens, block_size, 8, 2, D,
                                         dtype=torch.bfloat16, device="cuda")
    with flex_prefill("flash"):
        default_flex().q_tiles = q_tiles  # (the engine's: reserve_workspace and ModelRunner.wide_q_tiles choose)
        out = paged_attention(q, kc, vc, torch.tensor(tables, dtype=torch.int32, device="cuda"),
                              torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                              torch.tensor(query_lens, dtype=torch.int32, device="cuda"),
                              mask_mod=mask, score_mod=score, backend="flex")
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, plain, plain_score)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert "cannot compile" not in caplog.text  # FA4 served, not the Triton fallback


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_decode_matches_dense_reference(splits):
    """Decode rows split over slices of their pages and merged by log-sum-exp (the GPU's long-context path)."""
    from flexengine.attention.backends.flex import FlexBackend
    from flexengine.attention.metadata import build_metadata
    from flexengine.attention.layout import plan_layout
    seq_lens, query_lens = [70, 33, 5, 40, 1], [1, 33, 1, 1, 1]
    q, kc, vc, tables = make_paged_batch(random.Random(splits), seq_lens, query_lens, 8, 4, 2, 16)
    for mask, plain in [("causal", PLAIN_MASKS["causal"]), (masks.sliding_window(20), PLAIN_MASKS["sliding_window"](20))]:
        layout = plan_layout(query_lens, seq_lens, pad_decode_to=6, decode_splits=splits)
        meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                              torch.empty(0, dtype=torch.long), layout, 8, kc.shape[0])
        meta.backend = backend = FlexBackend(compile=False)
        out = backend.forward(q, kc, vc, meta, masks.get_mask_mod(mask), masks.softcap(3.0), 0.25)
        ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, plain,
                                    lambda s, b, h, qq, kv: 3.0 * math.tanh(s / 3.0), scale=0.25)
        torch.testing.assert_close(out.double(), ref, atol=3e-4, rtol=3e-4)


def test_fa4_score_mods_get_fast_math_tanh():
    """torch lowers torch.tanh to the strict math.tanh in flex's FA4 code; the engine switches it to the fast-math
    form FA4's own softcap uses (1.6x slower prefill with a softcap mod otherwise, docs/benchmarks.md)."""
    overrides = pytest.importorskip("torch._inductor.codegen.cutedsl.cutedsl_op_overrides")
    from flexengine.attention.backends.prefill_kernel import use_fast_tanh
    assert use_fast_tanh()
    assert overrides.CuteDSLOpOverrides.tanh("s") == "cute.math.tanh(s, fastmath=True)"


def test_flex_prefill_kernel_choice(caplog):
    """FLEXENGINE_FLEX_PREFILL: a bad value names the choices; flash asked for where FA4 cannot run is a
    ValueError saying why; auto is Triton; once FA4 refuses a mod, Triton serves, and that is said."""
    from flexengine.attention.backends.prefill_kernel import PrefillKernel
    q = torch.zeros(1, 2, 128, 64)
    with flex_prefill("fast"), pytest.raises(ValueError, match="auto, triton, flash"):
        PrefillKernel()
    with flex_prefill("flash"), pytest.raises(ValueError, match="FLEXENGINE_FLEX_PREFILL=flash, but FA4 needs a CUDA"):
        PrefillKernel().options(q)
    with flex_prefill("auto"):
        kernel = PrefillKernel()
    assert kernel.options(q) == {} and kernel.flash is False  # CPU: Inductor's own template
    assert not kernel.refused(RuntimeError("a Triton failure"))  # not FA4's: propagates
    kernel.flash = True  # as with FLEXENGINE_FLEX_PREFILL=flash on a GPU with FA4 installed
    with caplog.at_level("WARNING", logger="flexengine"):
        assert kernel.refused(RuntimeError("CuteDSL template failed: =====\nUNSUPPORTED CUTEDSL OPERATION: 'minimum'"))
    assert kernel.flash is False and "UNSUPPORTED CUTEDSL OPERATION: 'minimum'" in caplog.text


def test_score_mods_of_the_score_alone_skip_the_coordinate_mapping():
    """paged_score hands flex a score mod that reads no coordinate (softcap, a scaling) as it is: its kernel then
    captures none of the step's tensors that map physical coordinates back to logical ones. A mod that reads any
    index (ALiBi, a branch on the query, an index's shape, a per-request parameter) keeps the mapping, and so does
    one whose probe fails for any other reason."""
    from flexengine.attention.backends.paged_mods import paged_score, reads_coordinates
    from flexengine.attention.layout import plan_layout
    from flexengine.attention.metadata import build_metadata

    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    def later_queries_louder(score, b, h, q_idx, kv_idx):
        return score * 2 if q_idx > 3 else score

    def by_shape(score, b, h, q_idx, kv_idx):
        return score + kv_idx.shape[0]

    def per_request(score, b, h, q_idx, kv_idx, temperature):
        return score / temperature[b]

    def broken(score, b, h, q_idx, kv_idx):
        raise RuntimeError("not a mod")

    assert not reads_coordinates(masks.softcap(30.0)) and not reads_coordinates(halve)
    for mod in (masks.alibi([0.5, 0.25]), later_queries_louder, by_shape, per_request, broken):
        assert reads_coordinates(mod), mod
    layout = plan_layout([1, 3], [5, 3], block_size=4)
    meta = build_metadata(torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([5, 3], dtype=torch.int32),
                          torch.arange(4), layout, 4, 3, {"temperature": torch.ones(2)})
    cap = masks.softcap(30.0)
    assert paged_score(meta, cap, True) is cap and paged_score(meta, cap, False) is cap
    assert paged_score(meta, per_request, False) is not per_request
