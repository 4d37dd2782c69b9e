"""The one-row projection kernels (layers/gemv.py): the Triton kernel, run by Triton's interpreter on the CPU,
against the same arithmetic written plainly in torch; and the decoder's one-row path (the norms folded
into the projections) against its ordinary path, on every family, through the engine."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams
from flexengine.layers import gemv as G
from flexengine.layers.activation import act_and_mul
from flexengine.layers.norms import RMSNorm

pytest.importorskip("triton")


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_the_kernel_under_triton_s_interpreter():
    """The kernel test below, on the CPU: Triton's interpreter must be chosen before triton is first imported,
    so it runs in a process of its own. float32 only: the interpreter rounds to bfloat16 by truncation, where a
    GPU rounds to nearest (bfloat16 runs in the GPU test)."""
    if torch.cuda.is_available() or INTERPRETED:
        pytest.skip("the GPU runs the kernel natively; an interpreted process runs the test itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           f"{__file__}::test_the_kernel_equals_the_plain_arithmetic",
                           f"{__file__}::test_the_rows_kernel_equals_a_plain_matmul",
                           f"{__file__}::test_the_silu_and_mul_kernel_equals_the_plain_arithmetic",
                           f"{__file__}::test_the_rope_epilogue_rotates_q_and_k_and_stores_k_and_v"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@contextlib.contextmanager
def prefetching(tiles: int):
    """gemv.PREFETCH set for the launches inside (hypothesis's tests cannot take the monkeypatch fixture)."""
    default, G.PREFETCH = G.PREFETCH, tiles
    try:
        yield
    finally:
        G.PREFETCH = default


def plain(prologue: int, x, a, b, nw, w, eps: float, gated: bool = False):
    """(the projection, the residual sum) as the model's eager modules compute them, rounding where they round;
    `gated`: the projection through the MLP's SiLU-and-mul."""
    if gated:
        out, h = plain(prologue, x, a, b, nw, w, eps)
        return act_and_mul(out, "silu"), h
    dtype = x.dtype
    if prologue == 1:
        h = x.float()
        for t in (a, b):
            if t is not None:
                h = h + t.float()
        h = h.to(dtype)
        norm = RMSNorm(x.shape[1], eps).to(x.device)
        norm.weight.data = nw
        x = norm(h)
        return F.linear(x.float(), w.float()), h
    return F.linear(x.float(), w.float()), None


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), k=st.sampled_from([1, 7, 64, 1000, 1024, 1500, 2049]), prologue=st.sampled_from([0, 1]),
       summands=st.integers(0, 2), gated=st.booleans(), bf16=st.booleans(), prefetch=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_the_kernel_equals_the_plain_arithmetic(n, k, prologue, summands, gated, bf16, prefetch, seed):
    """On a GPU natively (bfloat16 and float32); on the CPU only inside the interpreted process above. `prefetch`:
    that many weight tiles loaded ahead of the loop (gemv.PREFETCH)."""
    if not torch.cuda.is_available() and not INTERPRETED:
        pytest.skip("runs in test_the_kernel_under_triton_s_interpreter's process on the CPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = bf16 and device == "cuda"
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    x = rand(1, k)
    a, b = (rand(1, k) if prologue == 1 and summands > i else None for i in range(2))
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype).to(device) if prologue == 1 else None
    w = rand(2 * n if gated else n, k)
    with prefetching(prefetch):
        got, total = G._launch(x, a, b, nw, w, prologue, 1e-5, write_sum=prologue == 1, gated=gated)
    want, want_total = plain(prologue, x, a, b, nw, w, 1e-5, gated)
    want = want.detach()
    assert got.shape == (1, n) and got.dtype == dtype
    # float32: summation order only; bf16: the output's rounding, and a norm input one rounding apart at most
    tol = 1e-4 if not bf16 else 2e-2
    assert (got.float() - want).abs().max() <= tol * (want.abs().max() + 1), (got, want)
    if prologue == 1:
        assert torch.equal(total, want_total)  # the residual stream, bit for bit
    # a float32 output (the LM head's logits) holds the same values, rounded to the model's dtype
    got32 = G._launch(x, a, b, nw, w, prologue, 1e-5, write_sum=prologue == 1, gated=gated, out_dtype=torch.float32)[0]
    assert got32.dtype == torch.float32 and torch.equal(got32, got.float())


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(m=st.integers(2, 64), n=st.one_of(st.integers(1, 40), st.sampled_from([3073, 16390])),
       k=st.sampled_from([16, 100, 256, 1000, 2049]), prefetch=st.integers(0, 1), float32_out=st.booleans(),
       gated=st.booleans(), seed=st.integers(0, 2**16))
def test_the_rows_kernel_equals_a_plain_matmul(m, n, k, prefetch, float32_out, gated, seed):
    """The few-rows kernel (gemv.FEW_ROWS): every row of x against the weight, rows and columns past the tiles
    masked, in each of rows_tiles' tile shapes; bf16 on a GPU, float32 in the interpreted process on the CPU.
    `gated` (gemv.gate_up_silu): the weight is [gate; up] and the output silu(gate) * up, as the MLP's act_and_mul."""
    if not torch.cuda.is_available() and not INTERPRETED:
        pytest.skip("runs in test_the_kernel_under_triton_s_interpreter's process on the CPU")
    k = k if n <= 40 else min(k, 100)  # (wide weights: the interpreter's time)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    x, w = (torch.randn(*shape, generator=g).to(dtype).to(device) for shape in ((m, k), ((2 if gated else 1) * n, k)))
    float32_out = float32_out and not gated  # (the gated output feeds the down projection: the model's dtype)
    with prefetching(prefetch):
        got = G._launch_rows(x, w, torch.float32 if float32_out else None, gated=gated)
    want = F.linear(x.float(), w.float())
    if gated:
        want = act_and_mul(want.to(dtype), "silu").float()  # (the projection rounded first, as cuBLAS's output)
    assert got.shape == (m, n) and got.dtype == (torch.float32 if float32_out else dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # summation order; bf16: the output's rounding
    assert (got.float() - want).abs().max() <= tol * (want.abs().max() + 1), (got, want)
    if float32_out:  # the float32 output holds the model dtype's values
        assert torch.equal(got, got.to(dtype).float())


@pytest.mark.gpu
@settings(max_examples=15, deadline=None)
@given(tokens=st.one_of(st.integers(0, 40), st.just(300)), n=st.sampled_from([1, 7, 1024, 1500, 2100]),
       seed=st.integers(0, 2**16))
def test_the_silu_and_mul_kernel_equals_the_plain_arithmetic(tokens, n, seed):
    """gate_up_silu's kernel past GATE_UP_ROWS (after cuBLAS's projection): silu(gate) * up of each row's halves,
    columns past its blocks masked, no rows at all included."""
    device, dtype, g, rand = kernel_inputs(seed)
    x = rand(tokens, 2 * n)
    got = G._silu_and_mul(x)
    assert got.shape == (tokens, n) and got.dtype == dtype
    want = act_and_mul(x.float(), "silu")
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def rotate(x, cos, sin):
    """Rotary in the neox layout, in float32: (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos.float() - x2 * sin.float(), x2 * cos.float() + x1 * sin.float()), dim=-1)


def kernel_inputs(seed: int):
    """(device, dtype, generator, rand(*shape)) for a kernel's test: bf16 on a GPU, float32 in the process that
    Triton's interpreter runs on the CPU (the ordinary CPU process skips: its interpreter test runs the test)."""
    if not torch.cuda.is_available() and not INTERPRETED:
        pytest.skip("runs in test_the_kernel_under_triton_s_interpreter's process on the CPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    return device, dtype, g, lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(q_heads=st.sampled_from([1, 2, 4]), kv_heads=st.sampled_from([1, 2]), half=st.sampled_from([2, 4, 32, 36]),
       k=st.sampled_from([7, 64, 1000]), page=st.sampled_from([1, 4]), summands=st.integers(0, 2),
       prefetch=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_the_rope_epilogue_rotates_q_and_k_and_stores_k_and_v(q_heads, kv_heads, half, k, page, summands, prefetch,
                                                             seed):
    """norm_gemv_rope's kernel: the projection as norm_gemv's, q and k rotated, q returned, k and v stored at the
    slot and nowhere else in the caches; bf16 on a GPU, float32 in the interpreted process on the CPU."""
    device, dtype, g, rand = kernel_inputs(seed)
    D, pages = 2 * half, 3
    x, nw = rand(1, k), (torch.rand(k, generator=g) + 0.5).to(dtype).to(device)
    a, b = (rand(1, k) if summands > i else None for i in range(2))
    w = rand((q_heads + 2 * kv_heads) * D, k)
    angle = torch.rand(half, generator=g) * 6.28
    cos, sin = angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device)
    slot = torch.randint(0, pages * page, (1,), generator=g).to(device)
    k_cache, v_cache = rand(pages, page, kv_heads, D), rand(pages, page, kv_heads, D)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with prefetching(prefetch):
        q, total = G._launch(x, a, b, nw, w, 1, 1e-5, write_sum=True,
                             rope=(cos, sin, slot, k_cache, v_cache, q_heads, kv_heads))
    qkv, want_total = plain(1, x, a, b, nw, w, 1e-5)
    qkv = qkv.to(dtype).view(-1, D)  # the projection rounded as stored, then rotated in float32
    want_q = rotate(qkv[:q_heads], cos, sin).reshape(1, -1)
    want_k, want_v = rotate(qkv[q_heads:q_heads + kv_heads], cos, sin), qkv[q_heads + kv_heads:].float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = qkv.float().abs().max() + 1
    assert q.shape == (1, q_heads * D) and torch.equal(total, want_total)
    assert (q.float() - want_q).abs().max() <= tol * scale
    p, o = int(slot) // page, int(slot) % page
    assert (k_cache[p, o].float() - want_k).abs().max() <= tol * scale
    assert (v_cache[p, o].float() - want_v).abs().max() <= tol * scale
    k_before[p, o], v_before[p, o] = k_cache[p, o], v_cache[p, o]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)  # nothing else written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch is a CUDA launch")
def test_the_kernel_launched_with_pdl_computes_the_same(monkeypatch):
    """FLEXENGINE_PDL's launch (griddepcontrol wait and trigger in the kernel, launch_pdl on the launch) changes
    when the kernel may start, not what it computes: bit for bit what the plain launch gives, with weight tiles read
    before the wait (gemv.PREFETCH) or not."""
    g = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()  # noqa: E731
    x, a, nw, w = rand(1, 2048), rand(1, 2048), rand(2048) + 1, rand(512, 2048)
    runs = []
    for pdl, prefetch in ((False, 0), (True, 0), (True, 1), (True, 2)):
        monkeypatch.setattr(G, "PDL", pdl)
        monkeypatch.setattr(G, "PREFETCH", prefetch)
        runs.append([G._launch(x, a, None, nw, w, 1, 1e-5, write_sum=True, gated=gated) for gated in (False, True)]
                    + [G._launch(x, None, None, None, w, 0)])
    for run in runs[1:]:
        for (plain, plain_sum), (pdl, pdl_sum) in zip(runs[0], run):
            assert torch.equal(plain, pdl) and torch.equal(plain_sum, pdl_sum)


def test_the_ops_off_cuda_are_the_plain_arithmetic():
    """The custom ops' CPU implementations (what the fake kernels trace against, and the decoder test below runs)."""
    g = torch.Generator().manual_seed(0)
    x, a, b, nw = (torch.randn(1, 48, generator=g) for _ in range(4))
    w = torch.randn(10, 48, generator=g)
    out, total = G.norm_gemv(x, a, b, nw[0], w, 1e-6)
    want, want_total = plain(1, x, a, b, nw[0], w, 1e-6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(total, want_total)
    out, total = G.norm_gemv(x, a, b, nw[0], w, 1e-6, True)
    torch.testing.assert_close(out, plain(1, x, a, b, nw[0], w, 1e-6, gated=True)[0])
    assert out.shape == (1, 5)
    torch.testing.assert_close(G.gemv(x, w), F.linear(x, w))
    rows = torch.randn(3, 48, generator=g)
    torch.testing.assert_close(G.gate_up_silu(rows, w), act_and_mul(F.linear(rows, w), "silu"))
    assert torch.equal(G.gemv(x.bfloat16(), w.bfloat16(), True), F.linear(x.bfloat16(), w.bfloat16()).float())


def test_one_row_takes_cuda_16_bit_single_rows_only(monkeypatch):
    monkeypatch.setattr(G, "ENABLED", True)
    assert not G.one_row(torch.zeros(1, 8, dtype=torch.bfloat16))  # the CPU keeps the plain path
    if torch.cuda.is_available():
        assert G.one_row(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda"))
        assert not G.one_row(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"))
        assert not G.one_row(torch.zeros(1, 8, device="cuda"))
        monkeypatch.setattr(G, "ENABLED", False)
        assert not G.one_row(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda"))


def test_the_lm_head_takes_the_rows_kernel_up_to_head_rows(monkeypatch):
    """HEAD_ROWS puts the LM head alone on the kernel for 2..HEAD_ROWS rows (one row always, when it serves); FEW_ROWS
    every projection, the head included; nothing where the device or dtype is not served."""
    monkeypatch.setattr(G, "ENABLED", True)
    monkeypatch.setattr(G, "serves", lambda device, dtype: dtype == torch.bfloat16)
    rows = lambda n, dtype=torch.bfloat16: G.head_rows(torch.empty(n, 8, dtype=dtype))  # noqa: E731
    for head, few, want in ((0, 0, [1]), (32, 0, [1, 2, 4, 8, 16, 32]), (0, 4, [1, 2, 4]), (8, 16, [1, 2, 4, 8, 16]),
                            (64, 0, [1, 2, 4, 8, 16, 32, 33, 64])):
        monkeypatch.setattr(G, "HEAD_ROWS", head)
        monkeypatch.setattr(G, "FEW_ROWS", few)
        assert [n for n in (1, 2, 4, 8, 16, 32, 33, 64) if rows(n)] == want, (head, few)
        assert not rows(2, torch.float32) and not rows(1, torch.float32)


@pytest.mark.parametrize("family", ["llama", "llama_tied_mha", "qwen2", "qwen3", "gemma2"])
def test_the_decoders_one_row_path_equals_its_ordinary_path(family, tmp_path, monkeypatch):
    """Batch-1 decode with one_row forced on the CPU (the ops' plain implementations: what is checked here is
    which weights, norms, residuals and reductions the decoder hands them) gives the tokens and logprobs of the
    ordinary path. Families with biases or Gemma's norms keep the ordinary path where they must."""
    from test_models_parity import make_checkpoint
    from flexengine.models import decoder
    from flexengine.parallel import layers as row_layers
    _, path = make_checkpoint(family, tmp_path)
    monkeypatch.setattr(G, "ROPE_EPILOGUE", True)  # (the default; a test before may have turned it off)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250]}, {"prompt_token_ids": [1, 2, 3]}]

    folds, specs = [], []

    def run():
        llm = LLM(path, device="cpu", max_num_seqs=1)  # decode steps of one row
        folds.append(llm.llm_engine.runner.model.one_row_projections())
        specs.append(llm.llm_engine.runner.model.spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs]) for o in outs]

    ordinary = run()
    calls, norm_folds, row_parallel = [], [], []
    forced = lambda x: calls.append(x.shape[0]) or x.shape[0] == 1  # noqa: E731
    monkeypatch.setattr(decoder, "one_row", forced)
    monkeypatch.setattr(decoder, "head_rows", forced)
    monkeypatch.setattr(row_layers, "one_row", forced)
    norm_gemv, norm_gemv_rope, gemv = decoder.norm_gemv, decoder.norm_gemv_rope, row_layers.gemv
    monkeypatch.setattr(decoder, "norm_gemv", lambda *a: norm_folds.append(a[-1] if len(a) == 7 else False)
                        or norm_gemv(*a))
    monkeypatch.setattr(decoder, "norm_gemv_rope", lambda *a: norm_folds.append("rope") or norm_gemv_rope(*a))
    monkeypatch.setattr(row_layers, "gemv", lambda x, w: row_parallel.append(w.shape) or gemv(x, w))
    folded = run()
    assert calls and 1 in calls
    # which projections take the kernels: qwen2's q/k/v has a bias, llama_tied_mha's every projection, Gemma's norms
    # are 1 + w (its o and down take the plain GEMV); Qwen3's per-head norm keeps rotary out of q/k/v's epilogue
    rope = "rotary and the K/V store (q/k/v's epilogue)"
    want = {"qwen2": ["gate/up", "o", "down"], "gemma2": ["o", "down"], "llama_tied_mha": [],
            "qwen3": ["q/k/v", "gate/up", "o", "down"]}.get(family, ["q/k/v", rope, "gate/up", "o", "down"])
    assert folds == [want + ["LM head"]] * 2
    assert (True in norm_folds) == ("gate/up" in want)  # gate/up with SiLU-and-mul as its epilogue
    assert ("rope" in norm_folds) == (rope in want)  # q/k/v with rotary and the cache store as its epilogue
    assert (False in norm_folds) == ("q/k/v" in want and rope not in want)
    spec = specs[0]
    o_shape, down_shape = (spec.hidden_size, spec.num_heads * spec.head_dim), (spec.hidden_size, spec.intermediate_size)
    assert {o_shape, down_shape} & set(row_parallel) == {s for s, name in ((o_shape, "o"), (down_shape, "down"))
                                                         if name in want}
    assert_same_tokens_and_logprobs(ordinary, folded)


def assert_same_tokens_and_logprobs(runs, runs2, tol: float = 1e-4):
    """Two runs' [(token ids, logprobs) per request]: the same tokens, the same top logprobs within tol."""
    for (tokens, logprobs), (tokens2, logprobs2) in zip(runs, runs2, strict=True):
        assert tokens == tokens2
        for step, step2 in zip(logprobs[0], logprobs2[0]):
            assert step.keys() == step2.keys()
            for tok in step:
                assert abs(step[tok].logprob - step2[tok].logprob) < tol


def test_the_one_row_ops_trace_in_the_compiled_regions_without_recompiles(gpu_shaped_engines, tmp_path, monkeypatch):
    """The CUDA engine's path on the CPU (dynamo traces the layer regions and the batch-1 decode graph's step):
    with the one-row path forced, dynamo takes the custom ops (None summands, two outputs) into the regions,
    the tokens are the plain engine's, and nothing compiles after the warm-up."""
    from test_models_parity import make_checkpoint
    from flexengine.compile import compile_count
    from flexengine.models import decoder
    from flexengine.parallel import layers as row_layers
    _, path = make_checkpoint("llama", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250]}, {"prompt_token_ids": [1, 2, 3]}]
    config = dict(device="cpu", max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128)
    sums, gemvs = [], []  # counted inside the ops' implementations, which dynamo does not trace
    reference_sum, reference_gemv = G._reference_sum, G._reference_gemv
    monkeypatch.setattr(G, "_reference_sum", lambda *a: sums.append(1) or reference_sum(*a))
    monkeypatch.setattr(G, "_reference_gemv", lambda *a: gemvs.append(a[1].shape) or reference_gemv(*a))
    monkeypatch.setattr(decoder, "one_row", lambda x: x.shape[0] == 1)
    monkeypatch.setattr(decoder, "head_rows", lambda x: x.shape[0] == 1)
    monkeypatch.setattr(row_layers, "one_row", lambda x: x.shape[0] == 1)  # o and down
    monkeypatch.setattr(G, "ROPE_EPILOGUE", True)  # q/k/v with rotary and the cache store, a mutating op in a region
    folded = LLM(path, **config)
    assert folded.llm_engine.runner.static_shapes
    before, ran, ran_gemv = compile_count(), len(sums), len(gemvs)
    got = folded.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    assert len(sums) > ran  # the decode steps ran the one-row ops: the folded norms,
    spec = folded.llm_engine.runner.model.spec  # and o, down and the LM head on the plain GEMV
    want = {(spec.hidden_size, spec.num_heads * spec.head_dim), (spec.hidden_size, spec.intermediate_size),
            (spec.vocab_size, spec.hidden_size)}
    assert want <= set(gemvs[ran_gemv:]), (want, set(gemvs[ran_gemv:]))
    monkeypatch.undo()
    gpu_shaped_engines()
    want = LLM(path, device="cpu", max_num_seqs=1).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_few_rows_on_the_gemv_give_the_plain_tokens_without_recompiles(gpu_shaped_engines, tmp_path, monkeypatch):
    """gemv.FEW_ROWS forced on the CPU (the ops' plain implementations), on the CUDA engine's path: decode steps of
    2-4 rows hand q/k/v, gate/up, o, down and the LM head to `gemv` (compiled regions now guard on the row count:
    the warm-up must compile both sides of it), the tokens are the plain engine's, and nothing compiles after the
    warm-up."""
    from test_models_parity import make_checkpoint
    from flexengine.compile import compile_count
    from flexengine.layers import linear
    from flexengine.models import decoder
    from flexengine.parallel import layers as row_layers
    _, path = make_checkpoint("llama", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250]}, {"prompt_token_ids": [1, 2, 3]},
               {"prompt_token_ids": [9, 8, 7, 6]}]
    config = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    gemvs = []  # the weight shape and row count of each call, counted inside the op (dynamo does not trace it)
    reference_gemv = G._reference_gemv
    monkeypatch.setattr(G, "_reference_gemv", lambda *a: gemvs.append((a[1].shape, a[0].shape[0]))
                        or reference_gemv(*a))
    for module in (linear, row_layers):
        monkeypatch.setattr(module, "few_rows", lambda x: 1 < x.shape[0] <= 4)
    monkeypatch.setattr(decoder, "head_rows", lambda x: 1 < x.shape[0] <= 4)  # (the LM head: few_rows or HEAD_ROWS)
    folded = LLM(path, **config)
    before, ran = compile_count(), len(gemvs)
    got = folded.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    spec = folded.llm_engine.runner.model.spec
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    want = {(qkv, spec.hidden_size), (2 * spec.intermediate_size, spec.hidden_size),
            (spec.hidden_size, spec.num_heads * spec.head_dim), (spec.hidden_size, spec.intermediate_size),
            (spec.vocab_size, spec.hidden_size)}
    assert want <= {shape for shape, rows in gemvs[ran:] if rows > 1}, gemvs[ran:]
    monkeypatch.undo()
    gpu_shaped_engines()
    plain = LLM(path, device="cpu", max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
