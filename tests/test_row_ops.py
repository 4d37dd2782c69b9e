"""The ops of steps of more than one row that fold a layer's small kernels: rotary.rotary_store (q and k rotated,
k and v stored into the paged caches, one kernel), gemv.gate_up_silu (gate/up with SiLU-and-mul; its kernels are
tested in test_gemv.py) and linear.down_split (the down projection as two float32 partial sums, added in the next
norm). rotary_store's Triton kernel (run by Triton's interpreter on the CPU) against rotary and the
store written plainly, and rotary.cos_sin's (every step's cos/sin tables on CUDA) against the angles' cosines in
float64; the decoder's path through each op against its ordinary path, through the engine, eager and compiled."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams
from flexengine.layers import linear, rotary
from flexengine.layers.norms import rms_norm
from test_gemv import assert_same_tokens_and_logprobs, kernel_inputs, rotate

pytest.importorskip("triton")
COMPILE = torch.compile  # (before gpu_shaped_engines puts dynamo's eager backend in)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_the_kernels_under_triton_s_interpreter():
    """The two kernel tests below on the CPU, in a process of their own (Triton's interpreter is chosen at import)."""
    if torch.cuda.is_available() or INTERPRETED:
        pytest.skip("the GPU runs the kernels natively; an interpreted process runs the tests itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           f"{__file__}::test_the_kernel_rotates_q_and_k_and_stores_k_and_v_at_the_slots",
                           f"{__file__}::test_the_cos_sin_kernel_gives_each_angle_s_cosine_and_sine"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(tokens=st.one_of(st.integers(1, 70), st.just(1000)), half=st.sampled_from([2, 4, 32, 36, 40, 64]),
       out=st.sampled_from(["float32", "model"]), seed=st.integers(0, 2**16))
def test_the_cos_sin_kernel_gives_each_angle_s_cosine_and_sine(tokens, half, out, seed):
    """rotary.cos_sin's kernel (COS_SIN_KERNEL): positions up to 131,072 (a long context's), head sizes 4-128 (72
    and 80 too), a decode step's few tokens and a prompt chunk's many: each (token, j) is cos and sin of
    float32(position) * inv_freq[j] (the float32 angle the CPU path and transformers form, its cosine taken in
    float64 here), rounded to the outputs' dtype: float32 within a few float32 ulps, bf16 (the model dtype on a GPU)
    within one bf16 ulp."""
    from flexengine.layers.rotary import _launch_cos_sin, default_inv_freq
    device, dtype, g, _ = kernel_inputs(seed)
    dtype = torch.float32 if out == "float32" else dtype
    positions = torch.randint(0, 131072, (tokens,), generator=g)
    positions[0] = 0
    inv_freq = default_inv_freq(2 * half, 500000.0)
    cos, sin = _launch_cos_sin(positions.to(device), inv_freq.to(device), dtype)
    angle = (positions[:, None].float() * inv_freq[None, :]).double()
    tol = 2e-6 if dtype == torch.float32 else 2 ** -8
    for got, want in ((cos, angle.cos()), (sin, angle.sin())):
        assert got.shape == (tokens, 1, half) and got.dtype == dtype
        torch.testing.assert_close(got[:, 0].cpu().double(), want, atol=tol, rtol=0)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(tokens=st.one_of(st.integers(1, 40), st.just(300)), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4, 7]),
       half=st.sampled_from([2, 4, 32, 36, 40, 64]), page=st.sampled_from([1, 4, 16]),
       wider=st.integers(0, 3), stray=st.booleans(), seed=st.integers(0, 2**16))
def test_the_kernel_rotates_q_and_k_and_stores_k_and_v_at_the_slots(tokens, kv_heads, group, half, page, wider, stray,
                                                                    seed):
    """Random slots over a few pages (each token its own), GQA ratios 1-7, head sizes 4-128 (72 and 80 too), the
    projection a view with a wider row stride, a decode step's few tokens and a prompt chunk's many (other tiles):
    q comes out rotated, k rotated and v as it was land at each token's slot, and nothing else in the caches
    changes; `stray`: the first token's slot is -1, which stores nothing. bf16 on a GPU; float32 in the interpreted
    process."""
    device, dtype, g, rand = kernel_inputs(seed)
    q_heads, D = kv_heads * group, 2 * half
    pages = -(-tokens // page) + 2
    width = (q_heads + 2 * kv_heads) * D
    qkv = rand(tokens, width + wider)[:, :width]
    angle = torch.rand(tokens, 1, half, generator=g) * 6.28 * 100
    cos, sin = angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device)
    slots = torch.randperm(pages * page, generator=g)[:tokens].to(device)
    k_cache, v_cache = rand(pages, page, kv_heads, D), rand(pages, page, kv_heads, D)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    if stray:
        slots[0] = -1
    q = rotary._launch(qkv, cos, sin, slots, k_cache, v_cache, q_heads, kv_heads)
    heads = qkv.view(tokens, -1, D)
    want_q = rotate(heads[:, :q_heads], cos, sin).to(dtype)
    flat_k, flat_v = want_k_cache.view(-1, kv_heads, D), want_v_cache.view(-1, kv_heads, D)
    stored = slots >= 0
    flat_k[slots[stored]] = rotate(heads[stored, q_heads:q_heads + kv_heads], cos[stored], sin[stored]).to(dtype)
    flat_v[slots[stored]] = heads[stored, q_heads + kv_heads:]
    # float32 products summed in another order (a fused multiply-add) may round a bf16 result to its neighbour
    tol = 0 if dtype == torch.float32 else 1e-2
    assert q.shape == (tokens, q_heads, D)
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache, want_k_cache, atol=tol, rtol=tol)
    assert torch.equal(v_cache, want_v_cache)


def test_the_op_off_cuda_is_rotary_and_the_store():
    """The op's CPU implementation (what the decoder test below runs and dynamo's fake traces against)."""
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 5, 4, 2, 8
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g)
    angle = torch.rand(T, 1, D // 2, generator=g)
    k_cache, v_cache = torch.zeros(3, 4, Hkv, D), torch.zeros(3, 4, Hkv, D)
    slots = torch.tensor([11, 0, 5, 6, 2])
    q = rotary.rotary_store(qkv, angle.cos(), angle.sin(), slots, k_cache, v_cache, Hq, Hkv)
    heads = qkv.view(T, -1, D)
    torch.testing.assert_close(q, rotate(heads[:, :Hq], angle.cos(), angle.sin()))
    torch.testing.assert_close(k_cache.view(-1, Hkv, D)[slots], rotate(heads[:, Hq:Hq + Hkv], angle.cos(), angle.sin()))
    assert torch.equal(v_cache.view(-1, Hkv, D)[slots], heads[:, Hq + Hkv:])
    written = torch.zeros(12, dtype=torch.bool)
    written[slots] = True
    assert not k_cache.view(12, -1)[~written].any() and not v_cache.view(12, -1)[~written].any()


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 40), half=st.integers(1, 70), n=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_the_down_split_partial_sums_add_up_to_the_projection(tokens, half, n, seed):
    """layers/linear.py's down_split: the float32 products of K's two halves, [2, T, N], which `summed` adds and
    rounds to the model's dtype; against the projection written plainly (float64)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(tokens, 2 * half, generator=g), torch.randn(n, 2 * half, generator=g)
    parts = linear.down_split(x, w)
    assert parts.shape == (2, tokens, n) and parts.dtype == torch.float32
    want = x.double() @ w.double().T
    torch.testing.assert_close(parts[0].double(), x[:, :half].double() @ w[:, :half].double().T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear.summed(parts, torch.float32).double(), want, rtol=1e-5, atol=1e-4)
    assert linear.summed(parts, torch.bfloat16).dtype == torch.bfloat16
    assert linear.summed(want, torch.float32) is want  # a projection's own output passes through


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bmm's float32 out_dtype is CUDA's")
def test_the_down_split_on_the_gpu_equals_cublas_s_projection_eager_and_compiled():
    """bf16 on CUDA: cuBLAS's batched product with float32 partial sums, eager and through a region compiled as the
    engine's (dynamic rows, the sum and a norm after it), against F.linear's projection (rounded to bf16 once). The
    partial sums, the residual and the norm are one Triton kernel (a `.sum(0)` over the partials' dynamic dimension
    made them two: 15 launches a step at batch 32, session 43)."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2048, 8192, generator=g) * 0.02).to("cuda", torch.bfloat16)
    norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    region = torch.compile(lambda x, r: rms_norm(r + linear.summed(linear.down_split(x, w), r.dtype), norm_w, 1e-5,
                                                 False), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    _, code = run_and_get_code(region, torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16),
                               torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16))
    assert "".join(code).count("@triton.jit") == 1, "the partial sums and the norm are more than one kernel"
    for rows in (2, 8, 32):
        x = torch.randn(rows, 8192, generator=g).to("cuda", torch.bfloat16)
        r = torch.randn(rows, 2048, generator=g).to("cuda", torch.bfloat16)
        want = torch.nn.functional.linear(x, w)
        got = linear.summed(linear.down_split(x, w), torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()  # bf16 rounding apart
        torch.testing.assert_close(region(x, r), torch.nn.functional.rms_norm(r + want, (2048,), eps=1e-5), rtol=2e-2,
                                   atol=2e-2)


def generate(path, prompts, params, **config):
    llm = LLM(path, device="cpu", **config)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs]) for o in outs]


PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250]}, {"prompt_token_ids": [1, 2, 3]},
           {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]}]


# op → (the decoder's test of whether a step takes it, the families whose layers keep the ordinary path: Qwen3's
# per-head norm comes between q/k/v and rotary; Gemma 2's MLP is gelu's, and a norm follows it)
OPS = {"rotary_store": ("stores_rotary", {"qwen3"}), "gate_up_silu": ("takes_gate_up_silu", {"gemma2"}),
       "down_split": ("takes_down_split", {"gemma2"})}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_the_decoders_path_through_the_op_equals_its_ordinary_path(op, family, tmp_path, monkeypatch):
    """Prefill and decode steps of several rows with the op forced on the CPU (its plain implementation: what is
    checked is which projection, heads, rotary and slots, or weights, the decoder hands it) give the ordinary path's
    tokens and logprobs."""
    from test_models_parity import make_checkpoint
    from flexengine.models import decoder
    _, path = make_checkpoint(family, tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    config = dict(max_num_seqs=3, max_num_batched_tokens=16)  # the 12-token prompt's prefill meets decode rows
    ordinary = generate(path, PROMPTS, params, **config)
    rows = []
    takes, ordinary_families = OPS[op]
    implementation = getattr(decoder, op)
    monkeypatch.setattr(decoder, takes, lambda x: True)
    monkeypatch.setattr(decoder, op, lambda x, *a: rows.append(x.shape[0]) or implementation(x, *a))
    through_op = generate(path, PROMPTS, params, **config)
    assert (len(rows) > 0) == (family not in ordinary_families), rows
    assert not rows or max(rows) > 1
    assert_same_tokens_and_logprobs(ordinary, through_op)


@pytest.mark.parametrize("op", OPS)
def test_the_op_traces_in_the_compiled_regions_without_recompiles(op, gpu_shaped_engines, tmp_path, monkeypatch):
    """The CUDA engine's path on the CPU (dynamo traces the layer regions, the decode graphs' steps and the prefill
    steps): with the op forced, dynamo takes it (rotary_store mutates the caches) into the regions at every row count,
    the tokens are the plain engine's, and nothing compiles after the warm-up."""
    from test_models_parity import make_checkpoint
    from flexengine.attention import kv_cache
    from flexengine.compile import compile_count
    from flexengine.layers import gemv
    from flexengine.models import decoder
    _, path = make_checkpoint("llama", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = dict(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128)
    rows = []  # counted inside the op's implementation, which dynamo does not trace: its store, or its arithmetic
    if op == "down_split":  # plain torch ops, traced into the regions: the graphs that dynamo hands over are counted
        def counting(gm, example_inputs):
            rows.extend(2 for node in gm.graph.nodes if node.target is torch.bmm)
            return gm.forward
        monkeypatch.setattr(torch, "compile", lambda fn, options=None, **kw: COMPILE(fn, **{**kw, "backend": counting}))
    else:
        module, name = (kv_cache, "write_kv") if op == "rotary_store" else (gemv, "_reference_gate_up_silu")
        inner = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a: rows.append(a[2 if op == "rotary_store" else 0].shape[0])
                            or inner(*a))
    monkeypatch.setattr(decoder, OPS[op][0], lambda x: True)
    llm = LLM(path, device="cpu", **config)
    assert llm.llm_engine.runner.static_shapes
    before, ran = compile_count(), len(rows)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    if op == "down_split":
        assert ran > 0, "no compiled region holds the split's product"
    else:  # prefill and decode steps of several rows took it
        assert len(rows) > ran and max(rows[ran:]) > 1, rows[ran:]
    monkeypatch.undo()
    gpu_shaped_engines()
    want = LLM(path, device="cpu", **config).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
