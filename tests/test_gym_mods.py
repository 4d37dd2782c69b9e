"""attention-gym's mods, unchanged, on the paged cache, against the dense reference.

The contract under test (docs/attention.md): a mod is called only with `b` a request that has tokens,
`h` in [0, num_heads) and positions in [0, seq_len), so a mod may index a tensor it captures by position
when the tensor holds max_model_len entries (here: exactly the longest sequence) and by head when it
holds num_heads. Eager flex on the CPU evaluates the mask over the whole page pool, so any position of
another request or of padding that reached a mod would raise IndexError here.
"""
import random

import pytest
import torch
from attn_gym.masks import (generate_dilated_sliding_window, generate_doc_mask_mod, generate_global_sliding_window,
                            generate_prefix_lm_mask, generate_sliding_window)
from attn_gym.mods import generate_alibi_bias, generate_sandwich_bias, generate_tanh_softcap
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attention_reference import PLAIN_MASKS, as_plain, dense_paged_attention, make_paged_batch
from harness import fa4_reason, flex_prefill
from flexengine import LLM, SamplingParams, masks
from flexengine.attention import paged_attention
from flexengine.attention.backends.flex import FlexBackend
from flexengine.attention.metadata import build_metadata
from flexengine.attention.layout import plan_layout
from flexengine.models import default_model


def strict_mask(num_heads: int, device="cpu"):
    """Raises IndexError (through `guard`) on any coordinate outside the contract; `seq_len` is a
    per-request parameter holding each request's length."""
    guard = torch.zeros(1, dtype=torch.bool, device=device)

    def strict(b, h, q_idx, kv_idx, seq_len):
        L = seq_len[b]  # b past the step's requests raises here
        bad = (L < 1) | (h < 0) | (h >= num_heads) | (q_idx < 0) | (q_idx >= L) | (kv_idx < 0) | (kv_idx >= L)
        return guard[bad.long()] | (kv_idx <= q_idx)
    return strict


def plain_score(mod):
    def score(s, b, h, q, kv):
        return float(mod(torch.tensor(s, dtype=torch.float64), *(torch.tensor(x) for x in (b, h, q, kv))))
    return score


def gym_mask(kind: str, max_len: int, Hq: int, rng: random.Random, device="cpu"):
    """A gym mask (composed with causal where the gym's is bidirectional) sized to exactly max_len."""
    if kind == "global_sliding":  # Longformer: indexes a [max_len] tensor by q_idx and kv_idx
        is_global = torch.tensor([rng.random() < 0.1 for _ in range(max_len)], device=device)
        return masks.and_masks("causal", generate_global_sliding_window(rng.randint(0, 5), is_global))
    if kind == "document":  # document ids by position: indexes a [max_len] tensor
        cuts = sorted(rng.sample(range(1, max_len), min(3, max_len - 1)))
        offsets = torch.tensor([0, *cuts, max_len], device=device)
        return generate_doc_mask_mod(masks.causal, offsets)
    if kind == "per_head_window":  # a [Hq] table indexed by h
        window = torch.tensor([rng.randint(1, 20) for _ in range(Hq)], device=device)

        def per_head_window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window[h])
        return per_head_window
    if kind == "sliding":
        return masks.and_masks("causal", generate_sliding_window(rng.randint(0, 9)))
    if kind == "dilated":
        return masks.and_masks("causal", generate_dilated_sliding_window(rng.randint(2, 12), rng.randint(1, 3)))
    return generate_prefix_lm_mask(rng.randint(0, 20))


def gym_score(kind: str, max_len: int, Hq: int, device="cpu"):
    if kind == "sandwich":  # a [2 * max_len] table by q_idx - kv_idx and a [Hq] table by h
        return generate_sandwich_bias(Hq, max_len, d_bar=8, device=device)
    if kind == "alibi":
        return generate_alibi_bias(Hq)
    if kind == "softcap":
        return generate_tanh_softcap(5.0, approx=False)
    return None


@st.composite
def gym_cases(draw, max_len=70, block_sizes=(8, 16, 32)):
    block_size = draw(st.sampled_from(block_sizes))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3]))
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        L = draw(st.integers(1, max_len))
        reqs.append((L, draw(st.sampled_from([1, L, draw(st.integers(1, L))]))))
    mask = draw(st.sampled_from(["global_sliding", "document", "per_head_window", "sliding", "dilated", "prefix",
                                 "strict"]))
    score = draw(st.sampled_from([None, "sandwich", "alibi", "softcap"]))
    spare = draw(st.sampled_from([0, 5, 200]))  # a pool far larger than any one request
    return block_size, Hq, Hkv, reqs, mask, score, spare, draw(st.integers(0, 2**16))


def run_gym_case(case, backend, device="cpu", dtype=torch.float32):
    block_size, Hq, Hkv, reqs, mask_kind, score_kind, spare, seed = case
    rng = random.Random(seed)
    seq_lens, query_lens = [L for L, _ in reqs], [n for _, n in reqs]
    max_len = max(seq_lens)
    q, kc, vc, tables = make_paged_batch(rng, seq_lens, query_lens, block_size, Hq, Hkv, 16, spare_blocks=spare,
                                         dtype=dtype, device=device)
    params = {}
    if mask_kind == "strict":
        mask = strict_mask(Hq, device)
        params = {"seq_len": torch.tensor(seq_lens, device=device)}
        reference_mask = PLAIN_MASKS["causal"]
    else:  # the same mod twice: on the device for the engine, on the CPU for the reference's Python ints
        mask_seed = rng.random()
        mask = gym_mask(mask_kind, max_len, Hq, random.Random(mask_seed), device)
        reference_mask = as_plain(gym_mask(mask_kind, max_len, Hq, random.Random(mask_seed)))
    score = gym_score(score_kind, max_len, Hq, device)
    cpu_score = gym_score(score_kind, max_len, Hq)
    out = paged_attention(q, kc, vc, torch.tensor(tables, dtype=torch.int32, device=device),
                          torch.tensor(seq_lens, device=device), torch.tensor(query_lens, device=device),
                          mask_mod=mask, score_mod=score, backend=backend, attention_params=params)
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, reference_mask,
                                plain_score(cpu_score) if cpu_score else None)
    return out.double().cpu(), ref


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gym_cases())
@example((8, 2, 1, [(1, 1), (30, 30), (17, 1)], "strict", "sandwich", 200, 1))  # requests of unequal lengths
def test_gym_mods_on_the_paged_cache_match_the_dense_reference(case):
    out, ref = run_gym_case(case, "flex")
    torch.testing.assert_close(out, ref, atol=3e-4, rtol=3e-4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gym_cases())
def test_gym_mods_on_the_reference_backend(case):
    out, ref = run_gym_case(case, "reference")
    torch.testing.assert_close(out, ref, atol=3e-4, rtol=3e-4)


@pytest.mark.parametrize("splits", [1, 3])
def test_padded_rows_and_tiles_never_reach_the_mod(splits):
    """The CUDA graphs' shapes: decode rows of length-0 requests, padding decode rows and prefill tiles,
    split-KV. The strict mod raises on any coordinate outside the contract."""
    seq_lens, query_lens = [37, 20, 9], [1, 20, 1]
    rows = [*seq_lens, 0, 0]  # two padded requests, as a decode graph's buffers hold them
    q, kc, vc, tables = make_paged_batch(random.Random(splits), seq_lens, query_lens, 8, 4, 2, 16, spare_blocks=30)
    tables = tables + [tables[0], tables[1]]  # stale tables: only their length 0 says they are not live
    layout = plan_layout([*query_lens, 1, 1], [*seq_lens, 1, 1], pad_decode_to=6, pad_tiles_to=3,
                         decode_splits=splits)
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), layout, 8, kc.shape[0],
                          {"seq_len": torch.tensor(rows)})
    meta.backend = backend = FlexBackend(compile=False)
    pad_q = torch.cat([q, torch.randn(2, 4, 16)])
    sandwich = generate_sandwich_bias(4, max(seq_lens), d_bar=8)
    out = backend.forward(pad_q, kc, vc, meta, strict_mask(4), sandwich, 0.25)[: len(q)]
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, query_lens, PLAIN_MASKS["causal"], plain_score(sandwich),
                                scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-4, rtol=3e-4)


def test_the_check_uses_the_real_head_count_and_names_the_argument():
    # a per-head table for a one-head model: the old fixed 2-head check rejected it
    masks.check_score_mod(generate_sandwich_bias(1, 64), num_heads=1, max_len=64)
    with pytest.raises(ValueError, match=r"sandwich_mod raised IndexError on h in \[0, 2\).*size 1"):
        masks.check_score_mod(generate_sandwich_bias(1, 64), num_heads=2, max_len=64)
    short = torch.zeros(100, dtype=torch.bool)
    gsw = masks.and_masks("causal", generate_global_sliding_window(3, short))
    masks.check_mask_mod(gsw, num_heads=3, max_len=100)
    with pytest.raises(ValueError, match=r"global_sliding_window_3.* on q_idx in \[0, 101\) \(max_model_len 101\).*"
                                         r"size 100"):
        masks.check_mask_mod(gsw, num_heads=3, max_len=101)

    def reads_param_by_position(b, h, q_idx, kv_idx, window):
        return q_idx - kv_idx < window[kv_idx]
    with pytest.raises(ValueError, match=r"on kv_idx in \[0, 64\).*\[4\]-shaped"):
        masks.check_mask_mod(reads_param_by_position, num_heads=2, max_len=64, num_reqs=4)


SMALL = dict(max_num_seqs=4, max_model_len=96, num_kv_blocks=64, block_size=16)
HEADS = default_model.CONFIG["num_attention_heads"]  # the embedded default model's query heads


def test_llm_checks_a_gym_mod_on_its_heads_and_max_model_len():
    with pytest.raises(ValueError, match=r"q_idx in \[0, 96\) \(max_model_len 96\).*size 64"):
        LLM(mask_mod=masks.and_masks("causal", generate_global_sliding_window(2, torch.zeros(64, dtype=torch.bool))),
            **SMALL)
    with pytest.raises(ValueError, match=rf"h in \[0, {HEADS}\)"):
        LLM(score_mod=generate_sandwich_bias(HEADS - 1, 96), **SMALL)
    LLM(score_mod=generate_sandwich_bias(HEADS, 96), **SMALL)


def test_llm_serves_gym_mods_as_the_reference_backend_does():
    """A Longformer mask and a sandwich bias, chunked prefill and decode, against dense attention."""
    is_global = torch.zeros(SMALL["max_model_len"], dtype=torch.bool)
    is_global[[0, 5, 40]] = True
    mask = masks.and_masks("causal", generate_global_sliding_window(4, is_global))
    score = generate_sandwich_bias(HEADS, SMALL["max_model_len"], d_bar=16)
    prompts = ["The quick brown fox jumps over the lazy dog and keeps running far", "Hi", "abc " * 9]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(backend):
        llm = LLM(mask_mod=mask, score_mod=score, attention_backend=backend, max_num_batched_tokens=32, **SMALL)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks() == bm.num_blocks  # no page leaked
        return [o.outputs[0].token_ids for o in outs]
    assert run("flex") == run("reference")


# ---------------------------------------------------------------- GPU: the compiled kernel and the CUDA graphs
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each compiles its mods
@given(gym_cases(max_len=300, block_sizes=(16, 32, 64, 128)))  # the Triton kernel's KV tile is >= 16
def test_gym_mods_in_the_compiled_kernel(case):
    with flex_prefill("triton"):
        out, ref = run_gym_case(case, "flex", device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(fa4_reason() is not None, reason=f"FlashAttention-4 cannot run here: {fa4_reason()}")
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each: one FA4 JIT compile
@given(gym_cases(max_len=300, block_sizes=(16, 128)))
def test_gym_mods_in_fa4(case):
    with flex_prefill("flash"):
        out, ref = run_gym_case(case, "flex", device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gym_mods_under_cuda_graphs_equal_eager_without_recompiles():
    """Captured position and head tables, read inside the CUDA graphs (decode and mixed steps with padded
    rows and tiles), give the tokens of the engine without graphs, and nothing compiles after start-up."""
    from flexengine.compile import compile_count
    max_len = 512
    rng = random.Random(0)
    is_global = torch.zeros(max_len, dtype=torch.bool, device="cuda")
    is_global[[0, 7, 100]] = True
    mask = masks.and_masks("causal", generate_global_sliding_window(16, is_global))
    prompts = [{"prompt_token_ids": [rng.randrange(1, 250) for _ in range(rng.randint(20, 300))]} for _ in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for eager in (False, True):
        llm = LLM(mask_mod=mask, score_mod=generate_sandwich_bias(HEADS, max_len, d_bar=16, device="cuda"),
                  max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=512, max_model_len=max_len,
                  enforce_eager=eager)
        assert (llm.llm_engine.runner.decode_graphs is None) == eager
        before = compile_count()
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        assert compile_count() == before, "a gym mod recompiled after start-up"
        del llm
    assert results[0] == results[1]
