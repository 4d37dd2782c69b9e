"""Custom attention from Python, end to end: LLM(mask_mod=..., score_mod=...), per-request parameters,
and the prefix cache beside masks that look ahead. The dense reference backend is the oracle."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams, masks
from flexengine.compile import compile_count
from flexengine.engine.llm_engine import prefix_cache_unsafe_reason
from flexengine.engine.sequence import Sequence

SMALL = dict(block_size=8, num_kv_blocks=64)  # 8-token pages: every prompt spans several
PROMPTS = ["Hi", "The quick brown fox jumps over", "Paged attention with a custom mask, written in Python."]


def greedy(max_tokens=3, **attention_params):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          attention_params=attention_params or None)


def tokens(llm, prompts=PROMPTS, params=None):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params or greedy(), use_tqdm=False)]


# ---------------------------------------------------------------- random mods vs the dense reference
def sink(n):
    return lambda b, h, q_idx, kv_idx: kv_idx < n


def causal_stripes(k):  # causal, unbounded, and marked: the engine may stop its pages at the tile's last query
    def stripes(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % k != 1)
    stripes.causal_safe = True
    return stripes


def head_window(w):
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) < (h + 1) * w  # head h sees (h+1)*w back, and ahead


def same_chunk(c):
    return lambda b, h, q_idx, kv_idx: q_idx // c == kv_idx // c  # bidirectional inside a chunk


# A mod spec is a printable tuple, so a failing example reads as the mask it was.
LEAVES = {
    "causal": lambda: masks.causal, "window": masks.sliding_window, "chunk": masks.chunked_local,
    "prefix": masks.prefix_lm, "sink": sink, "head_window": head_window, "same_chunk": same_chunk,
    "stripes": causal_stripes,
}
leaf = st.one_of(
    st.just(("causal",)),
    st.tuples(st.sampled_from(["window", "head_window"]), st.integers(1, 12)),
    st.tuples(st.sampled_from(["chunk", "same_chunk"]), st.integers(2, 16)),
    st.tuples(st.just("prefix"), st.integers(0, 20)),
    st.tuples(st.just("sink"), st.integers(1, 6)),
    st.tuples(st.just("stripes"), st.integers(2, 4)),
)
mask_spec = st.recursive(leaf, lambda inner: st.tuples(st.sampled_from(["and", "or"]), inner, inner), max_leaves=4)
score_spec = st.sampled_from([None, ("softcap", 2.0), ("distance", 0.1)])


def build_mask(spec):
    if spec[0] in ("and", "or"):
        combine = masks.and_masks if spec[0] == "and" else masks.or_masks
        return combine(build_mask(spec[1]), build_mask(spec[2]))
    return LEAVES[spec[0]](*spec[1:])


def build_score(spec):
    if spec is None:
        return None
    if spec[0] == "softcap":
        return masks.softcap(spec[1])
    slope = spec[1]
    return lambda score, b, h, q_idx, kv_idx: score - slope * (q_idx - kv_idx).abs()


@settings(max_examples=8, deadline=None, derandomize=True)
# 64: the longest prompt (55 tokens) fits whole, as look-ahead masks need, yet the three together are chunked
@given(mask=mask_spec, score=score_spec, budget=st.sampled_from([64, 2048]))
def test_random_mods_match_the_dense_reference(mask, score, budget):
    """Flex over the paged cache (page lists from kv_bounds, chunked prefill) == dense math, token for token."""
    mods = dict(mask_mod=build_mask(mask), score_mod=build_score(score), max_num_batched_tokens=budget, **SMALL)
    flex = tokens(LLM(**mods))
    reference = tokens(LLM(attention_backend="reference", **mods))
    assert flex == reference


bounded_leaf = st.one_of(st.just(("causal",)), st.tuples(st.just("window"), st.integers(1, 12)),
                        st.tuples(st.just("chunk"), st.integers(2, 16)), st.tuples(st.just("prefix"), st.integers(0, 20)))
bounded_spec = st.recursive(bounded_leaf, lambda inner: st.tuples(st.sampled_from(["and", "or"]), inner, inner),
                            max_leaves=4)


@settings(max_examples=100, deadline=None)
@given(mask=st.one_of(bounded_spec, mask_spec), q_lo=st.integers(0, 40), span=st.integers(0, 16),
       extra=st.integers(0, 16))
def test_composed_kv_bounds_are_sound(mask, q_lo, span, extra):
    """The page lists come from kv_bounds (a part without them adds what any mask allows); eager flex on
    CPU evaluates the mask densely and would not notice bounds that drop an allowed key or call a
    partial page full, so check them directly."""
    mod = build_mask(mask)
    q_hi, L = q_lo + span, q_lo + span + 1 + extra
    bounds = masks.kv_bounds_of(mod)
    a_lo, a_hi, f_lo, f_hi = (int(x) for x in bounds(*(torch.tensor([x]) for x in (0, q_lo, q_hi, L))))
    q, kv = torch.arange(q_lo, q_hi + 1)[:, None], torch.arange(L)[None, :]
    allowed = mod(0, 0, q, kv)
    seen = allowed.any(0).nonzero().flatten()
    assert seen.numel() == 0 or (a_lo <= seen.min() and seen.max() < a_hi)
    assert allowed[:, max(f_lo, 0):max(f_hi, 0)].all()


# ---------------------------------------------------------------- per-request parameters
def prefix_lm_params(prefix_lens):
    return [greedy(4, prefix_len=p) for p in prefix_lens]


def step_params(llm, params):
    """The [R] tensors the runner would hand the mods for requests with these SamplingParams."""
    seqs = [Sequence(request_id=str(i), index=0, token_ids=[1], num_prompt_tokens=1, params=p) for i, p in enumerate(params)]
    return llm.llm_engine.runner.attention_params(seqs)


def test_per_request_prefix_lengths_in_one_batch_equal_each_request_alone():
    llm = LLM(mask_mod="prefix_lm", **SMALL)
    prefix_lens = [0, 9, 40]
    batched = tokens(llm, PROMPTS, prefix_lm_params(prefix_lens))
    alone = [tokens(llm, [p], prefix_lm_params([n]))[0] for p, n in zip(PROMPTS, prefix_lens)]
    assert batched == alone
    # The parameter is really read: prefix 0 is plain causal attention, a long prefix is not.
    assert batched[0] == tokens(LLM(**SMALL), PROMPTS[:1], [greedy(4)])[0]
    assert batched[2] != tokens(llm, PROMPTS[2:], prefix_lm_params([0]))[0]


def test_per_request_parameters_match_the_reference_and_are_int64():
    llm = LLM(mask_mod="prefix_lm", **SMALL)
    params = prefix_lm_params([3, 17, 30])
    assert tokens(llm, PROMPTS, params) == tokens(LLM(mask_mod="prefix_lm", attention_backend="reference", **SMALL),
                                                  PROMPTS, params)
    assert step_params(llm, params)["prefix_len"].dtype == torch.int64


def sharpened(score, b, h, q_idx, kv_idx, sharpness: float):
    return score * sharpness[b]


def test_float_parameters_are_float32():
    llm = LLM(score_mod=sharpened, **SMALL)
    got = step_params(llm, [greedy(sharpness=0.5), greedy(sharpness=2)])["sharpness"]  # an int converts
    assert got.dtype == torch.float32 and got.tolist() == [0.5, 2.0]
    assert step_params(llm, [greedy(sharpness=3)])["sharpness"].dtype == torch.float32  # ints alone too
    assert tokens(llm, PROMPTS[:2], [greedy(sharpness=1.0)] * 2) == tokens(LLM(**SMALL), PROMPTS[:2])
    assert tokens(llm, PROMPTS[2:], [greedy(sharpness=5.0)]) != tokens(LLM(**SMALL), PROMPTS[2:])


def per_request_softcap(score, b, h, q_idx, kv_idx, cap: float):
    return cap[b] * torch.tanh(score / cap[b])


def test_float_parameters_equal_the_same_values_baked_into_the_mod():
    """One batch with four caps == each request alone under the built-in softcap(c), c a Python number."""
    caps = [0.25, 0.5, 1.5, 40.0]  # float32-exact, so both compute the same numbers
    prompts = PROMPTS + ["Per-request caps"]
    batched = tokens(LLM(score_mod=per_request_softcap, **SMALL), prompts, [greedy(6, cap=c) for c in caps])
    alone = [tokens(LLM(score_mod=masks.softcap(c), **SMALL), [p], [greedy(6)])[0] for p, c in zip(prompts, caps)]
    assert batched == alone
    assert batched != tokens(LLM(**SMALL), prompts, greedy(6)), "the caps changed nothing"


@functools.cache
def int_and_float_llm():
    """prefix_len read as int64 by the mask, sharpness as float32 by the score mod."""
    return LLM(mask_mod="prefix_lm", score_mod=sharpened, **SMALL)


int64s = st.integers(-2 ** 63, 2 ** 63 - 1)
float32_exact = st.one_of(st.integers(-2 ** 24, 2 ** 24), st.floats(width=32, allow_nan=False, allow_infinity=False))


@settings(max_examples=200, deadline=None)
@given(prefix_len=int64s, sharpness=float32_exact)
def test_declared_dtypes_hold_whatever_the_values(prefix_len, sharpness):
    """Ints stay exact int64; a float parameter takes ints or floats as float32; a float for an int
    parameter is refused, naming the parameter and the annotation that would accept it."""
    llm = int_and_float_llm()
    values = {"prefix_len": prefix_len, "sharpness": sharpness}
    llm.llm_engine.inputs.validate_attention_params(values)
    got = step_params(llm, [greedy(**values)])
    assert got["prefix_len"].dtype == torch.int64 and got["prefix_len"].item() == prefix_len
    assert got["sharpness"].dtype == torch.float32 and got["sharpness"].item() == sharpness
    with pytest.raises(ValueError, match="'prefix_len'.*`prefix_len: float`"):
        llm.llm_engine.inputs.validate_attention_params({**values, "prefix_len": float(prefix_len)})


def test_missing_or_bad_parameter_is_rejected_before_anything_is_allocated():
    llm = LLM(mask_mod="prefix_lm", **SMALL)
    engine = llm.llm_engine
    free = engine.num_free_blocks()
    with pytest.raises(ValueError, match=r"prefix_lm.*'prefix_len'"):
        llm.generate(PROMPTS[:2], [greedy(prefix_len=4), greedy()], use_tqdm=False)  # the second lacks it
    with pytest.raises(ValueError, match="prefix_len"):
        engine.add_request("x", "hello", greedy(prefix_len="4"))
    with pytest.raises(ValueError, match="'prefix_length'"):  # a typo is an error, not a silent 0
        engine.add_request("x", "hello", greedy(prefix_len=4, prefix_length=4))
    assert engine.num_free_blocks() == free and not engine.has_unfinished_requests()
    assert len(tokens(llm, PROMPTS[:1], [greedy(5, prefix_len=4)])[0]) == 5  # still works
    assert engine.num_free_blocks() == free


def test_a_float_for_an_int_parameter_is_rejected_naming_the_annotation():
    llm = LLM(mask_mod="prefix_lm", **SMALL)
    engine = llm.llm_engine
    free = engine.num_free_blocks()
    with pytest.raises(ValueError, match=r"'prefix_len'.*int64.*annotate it `prefix_len: float`"):
        llm.generate(PROMPTS[:2], [greedy(prefix_len=4), greedy(prefix_len=4.0)], use_tqdm=False)
    assert engine.num_free_blocks() == free and not engine.has_unfinished_requests()
    assert len(tokens(llm, PROMPTS[:1], [greedy(5, prefix_len=4)])[0]) == 5  # still works
    assert engine.num_free_blocks() == free


def window_mask(b, h, q_idx, kv_idx, window):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < window[b])


def window_scaled(score, b, h, q_idx, kv_idx, window: float):
    return score / window[b]


def test_one_parameter_read_with_two_dtypes_is_an_error_naming_both_mods():
    with pytest.raises(ValueError, match=r"'window' is torch.int64 in window_mask but torch.float32 in window_scaled"):
        LLM(mask_mod=window_mask, score_mod=window_scaled, **SMALL)

    def float_window_mask(b, h, q_idx, kv_idx, window: float):
        return q_idx - kv_idx < window[b]

    with pytest.raises(ValueError, match=r"'window' is torch.int64 in window_mask but torch.float32 in float_window"):
        masks.and_masks(window_mask, float_window_mask)
    assert masks.request_params(masks.and_masks(window_mask, masks.causal), masks.MASK_ARGS) == {"window": torch.int64}


def test_annotations_declare_the_dtype_and_anything_else_is_an_error():
    # Strings, as `from __future__ import annotations` leaves every annotation.
    def string_annotated(score, b, h, q_idx, kv_idx, cap: "float", n: "int", m):
        return score

    assert masks.request_params(string_annotated, masks.SCORE_ARGS) == {"cap": torch.float32, "n": torch.int64,
                                                                        "m": torch.int64}

    def text_annotated(score, b, h, q_idx, kv_idx, cap: str):
        return score

    with pytest.raises(ValueError, match=r"text_annotated.*'cap' is annotated 'str'.*`float`"):
        LLM(score_mod=text_annotated, **SMALL)


# ---------------------------------------------------------------- LLM(mask_mod=...) overrides
def test_override_by_layer_index_changes_only_that_layer():
    window = masks.sliding_window(4)
    llm = LLM(mask_mod={0: window}, score_mod={1: masks.softcap(3.0)}, **SMALL)
    layers = llm.llm_engine.runner.layers
    assert [a.mask_mod for a in layers] == [window, masks.causal]
    assert [a.score_mod for a in layers] == [None, layers[1].score_mod] and layers[1].score_mod is not None
    assert tokens(llm) != tokens(LLM(**SMALL))


def test_override_by_kind_and_for_all_layers_uses_one_mod_object():
    llm = LLM(mask_mod={"global": "bidirectional", 1: "causal"}, **SMALL)  # an index key beats its kind
    assert [a.mask_mod for a in llm.llm_engine.runner.layers] == [masks.bidirectional, masks.causal]
    sink_window = masks.or_masks(sink(4), masks.sliding_window(8))
    layers = LLM(mask_mod=sink_window, **SMALL).llm_engine.runner.layers
    assert all(a.mask_mod is sink_window for a in layers)  # one BlockMask per step, not one per layer


@pytest.mark.parametrize("override, message", [
    ({2: "causal"}, "key 2"), ({-1: "causal"}, "key -1"), ({"sliding": "causal"}, "'sliding'"),
    ({"local": "causal"}, "'local'"), ({0: "no_such_mask"}, "no_such_mask"),
])
def test_bad_override_keys_are_errors_naming_them(override, message):
    with pytest.raises(ValueError, match=message):
        LLM(mask_mod=override, **SMALL)


def test_bad_custom_mods_fail_at_construction():
    with pytest.raises(ValueError, match="alibi"):
        LLM(score_mod=masks.alibi([0.5] * 3), **SMALL)  # the default model has 4 query heads
    with pytest.raises(ValueError, match="control flow"):
        LLM(mask_mod=lambda b, h, q_idx, kv_idx: q_idx if kv_idx > 0 else q_idx, **SMALL)
    with pytest.raises(ValueError, match="flash"):
        LLM(mask_mod=sink(4), attention_backend="flash", **SMALL)


# ---------------------------------------------------------------- the prefix cache beside look-ahead masks
def test_prefix_lm_turns_prefix_caching_off_and_matches_an_uncached_run():
    """Two prompts share their first pages; under a prefix-LM mask those pages' K/V (layer 1 on) depend on
    what follows, so reusing them would change the second request's output."""
    shared = "The quick brown fox jumps over "
    prompts = [shared + "the lazy dog.", shared + "a sleepy cat!"]

    def run(llm):
        enc = llm.get_tokenizer().encode
        return [tokens(llm, [p], [greedy(8, prefix_len=len(enc(p)))])[0] for p in prompts]  # one at a time

    cached = LLM(mask_mod="prefix_lm", enable_prefix_caching=True, **SMALL)
    assert run(cached) == run(LLM(mask_mod="prefix_lm", enable_prefix_caching=False, **SMALL))
    assert not cached.llm_engine.block_manager.enable_prefix_caching and cached.llm_engine.block_manager.num_hits == 0

    forced = LLM(mask_mod="prefix_lm", **SMALL)
    forced.llm_engine.block_manager.enable_prefix_caching = True  # what the rule prevents
    assert run(forced) != run(cached) and forced.llm_engine.block_manager.num_hits > 0


def test_causal_safe_masks_keep_the_prefix_cache():
    for mod in ("causal", masks.sliding_window(8), masks.and_masks(sink(4), masks.causal),
                masks.or_masks(masks.chunked_local(8), masks.sliding_window(4))):
        engine = LLM(mask_mod=mod, **SMALL).llm_engine
        assert engine.block_manager.enable_prefix_caching, prefix_cache_unsafe_reason(engine.runner.mods)
    for mod in ("bidirectional", masks.prefix_lm(4), sink(4), masks.or_masks(sink(4), masks.causal)):
        assert not LLM(mask_mod=mod, **SMALL).llm_engine.block_manager.enable_prefix_caching, mod


# ---------------------------------------------------------------- GPU: CUDA graphs, no recompiles
def sink_window(b, h, q_idx, kv_idx, window):
    return (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < window[b]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_custom_mod_under_cuda_graphs_equals_eager_without_recompiles():
    """An int parameter (window, read by the mask) and a float one (cap, read by the score mod)."""
    import random
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 250) for _ in range(rng.randint(20, 200))]} for _ in range(12)]
    values = [[(rng.randint(1, 64), rng.uniform(0.5, 20.0)) for _ in prompts] for _ in range(2)]
    params = [[greedy(24, window=w, cap=c) for w, c in pairs] for pairs in values]
    kw = dict(mask_mod=sink_window, score_mod=per_request_softcap, max_num_seqs=16, max_num_batched_tokens=512,
              num_kv_blocks=512)
    graphed = LLM(**kw)
    graphs = graphed.llm_engine.runner.decode_graphs
    assert graphs is not None
    replays, replay = [], graphs.replay
    graphs.replay = lambda n: replays.append(n) or replay(n)
    first = tokens(graphed, prompts, params[0])
    before = compile_count()
    second = tokens(graphed, prompts, params[1])  # other values: new tensor contents, same compiled code
    assert compile_count() == before, "changing per-request parameters recompiled"
    assert replays, "no decode step ran on the CUDA graphs"
    del graphed
    eager = LLM(enforce_eager=True, **kw)
    assert first == tokens(eager, prompts, params[0])
    assert second == tokens(eager, prompts, params[1])
    assert first != second


def test_look_ahead_masks_are_never_chunked():
    """A bidirectional prompt computed in 8-token chunks would let early tokens miss the later ones;
    with a look-ahead mask the engine computes each prompt whole, so a tiny chunk budget changes nothing."""
    prompts = ["a fairly long prompt that spans several chunks", "short one"]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    whole = LLM(mask_mod="bidirectional", max_num_batched_tokens=256, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, greedy, use_tqdm=False)]
    # room for the first prompt and 3 tokens more: a chunking scheduler would split the second prompt
    budget = len(whole.llm_engine.inputs.tokenize(prompts[0])[1]) + 3
    small = LLM(mask_mod="bidirectional", max_num_batched_tokens=budget, enforce_eager=True)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)]
    assert got == expected
    free = small.llm_engine.num_free_blocks()
    with pytest.raises(ValueError, match="must be computed in one step"):
        small.generate(["x" * (budget + 1)], greedy, use_tqdm=False)
    assert small.llm_engine.num_free_blocks() == free
