"""Structured outputs (xgrammar) offline: every output parses and validates against an independent checker
(jsonschema, re.fullmatch, the choice list), sampled, n > 1, mixed with unconstrained requests whose greedy
outputs must not change; invalid specs are ValueErrors that leave the engine usable with no page held."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

xgr = pytest.importorskip("xgrammar")
try:  # the dev extra's validator; the GPU box (Python 3.12, no rpds-py wheel carried) takes pure-Python fastjsonschema
    from jsonschema import validate as validate_json
except ImportError:
    fastjsonschema = pytest.importorskip("fastjsonschema", reason="needs jsonschema (dev extra) or fastjsonschema")

    def validate_json(value, schema):
        fastjsonschema.compile(schema)(value)

from flexengine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from flexengine.engine.scheduler import multi_step_ok  # noqa: E402
from flexengine.engine.structured_outputs import Grammars  # noqa: E402
from flexengine.layers.sampler import Sampler, apply_token_mask  # noqa: E402
from test_sampling import token_mask  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer",
         "minimum": 1, "maximum": 9}}, "required": ["color", "n"], "additionalProperties": False}
REGEX = r"(ab|cd){1,3}-[0-9]{2}"
CHOICES = ["yes", "no", "not sure", 'say "hi"']
# EBNF for "(" digits ")" lists, checked with an equivalent regex
GRAMMAR = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9] | [0-9] [0-9]'
GRAMMAR_RE = r"\[[0-9]{1,2}(,[0-9]{1,2})*\]"


@pytest.fixture(scope="module")
def llm():
    return LLM(seed=0, attention_backend="reference", num_kv_blocks=256)


def check(spec: StructuredOutputsParams, text: str) -> None:
    """The output satisfies the spec, by a checker that is not xgrammar."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        validate_json(json.loads(text), schema)
    elif spec.json_object:
        assert isinstance(json.loads(text), (dict, list)), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


SPECS = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=json.dumps(COLOR)),
         StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), StructuredOutputsParams(regex=REGEX),
         StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR)]


@pytest.mark.parametrize("spec", SPECS, ids=["json", "json-str", "json-compact", "regex", "choice", "grammar"])
def test_sampled_outputs_satisfy_the_spec(llm, spec):
    """temperature 1, several seeds, n = 3: every completion ends by EOS (the grammar's end) and validates."""
    params = [SamplingParams(temperature=1.0, seed=seed, n=3, max_tokens=200, structured_outputs=spec)
              for seed in range(3)]
    outs = llm.generate(["Answer: ", "Hello there", "x"], params, use_tqdm=False)
    texts = set()
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(spec, c.text)
            texts.add(c.text)
    assert len(texts) > 1 or spec.choice, "sampling should not collapse to one output"
    if spec.disable_any_whitespace:  # xgrammar's fixed separators, json.dumps' defaults
        assert all(t == json.dumps(json.loads(t)) for t in texts)
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks


def test_json_object_and_greedy(llm):
    spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    for seed in range(3):
        out = llm.generate(["{"], SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
        if out.finish_reason == "stop":
            check(spec, out.text)
        else:  # a random model may nest on: then a prefix the builtin grammar still accepts
            assert out.finish_reason == "length" and out.text[0] in "[{"
    greedy = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=60, structured_outputs=SPECS[3]),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.finish_reason == "stop"
    check(SPECS[3], greedy.text)


def unconstrained_requests(max_tokens=24):
    prompts = [f"Once upon a time {i}" + " and" * i for i in range(4)]
    return prompts, [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_neighbours_grammars_do_not_change_unconstrained_greedy_outputs(async_scheduling):
    """Grammar requests mixed into the batch (prefilling and decoding beside the others, with async
    scheduling too, where a grammar step reads its tokens back before the next launch): the unconstrained
    greedy outputs equal those of the same requests run alone, and the grammar outputs validate."""
    llm = LLM(seed=0, attention_backend="reference", num_kv_blocks=256, async_scheduling=async_scheduling,
              max_num_batched_tokens=64)
    prompts, params = unconstrained_requests()
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    specs = [SPECS[0], SPECS[3], SPECS[4], SPECS[5]]
    mixed_prompts, mixed_params = [], []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        mixed_prompts += [p, f"grammar {i}"]
        mixed_params += [sp, SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=200, structured_outputs=specs[i])]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == alone
    for out, spec in zip(outs[1::2], specs):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            check(spec, c.text)
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.num_total_blocks and not engine.grammar_seqs


def test_async_scheduling_gives_the_same_grammar_outputs():
    """With async scheduling a grammar step queues the next forward, then reads itself back (the grammars take
    its tokens) before the next mask is filled: seeded sampled outputs equal the synchronous engine's, grammars
    that end while the next step is queued included, beside unconstrained requests (which outlive the grammars:
    the engine goes back to its usual overlap), and nothing leaks."""
    prompts, params = [], []
    for i, spec in enumerate(SPECS):
        prompts += [f"grammar {i}", f"free {i}"]
        params += [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=60, structured_outputs=spec),
                   SamplingParams(temperature=1.0, seed=50 + i, max_tokens=3 + 15 * i, logprobs=1)]
    runs = []
    for overlap in (False, True):
        llm = LLM(seed=0, attention_backend="reference", num_kv_blocks=256, async_scheduling=overlap,
                  max_num_batched_tokens=64)
        engine = llm.llm_engine
        calls = {"forward": 0, "launch": 0}  # async: both of _grammar_step's ways on from a sampled step
        for name in calls:
            def counted(*args, _f=getattr(engine, name), _name=name):
                calls[_name] += 1
                return _f(*args)
            setattr(engine, name, counted)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs])
        assert engine.num_free_blocks() == engine.num_total_blocks and not engine.grammar_seqs
        assert engine.forwarded is None and engine.in_flight is None
        if overlap:
            assert calls["forward"] > 10 and calls["launch"] > 0, calls
    assert runs[0] == runs[1]
    assert all(-1 not in ids for out in runs[1] for ids, _, _ in out)
    for out, spec in zip(runs[1][0::2], SPECS):
        for _, text, reason in out:
            if reason == "stop":
                check(spec, text)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_state_survives_preemption(llm, async_scheduling):
    """A preempted grammar request is recomputed from its tokens; its matcher, which saw them all, goes on:
    the seeded outputs equal those of a roomy engine (with async scheduling too, where a step is scheduled,
    and may preempt, while the one before is forwarded but not yet sampled)."""
    prompts = [f"prompt {i}: " + "ab" * i for i in range(4)]
    specs = [SPECS[3], SPECS[4], SPECS[3], SPECS[4]]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(seed=0, attention_backend="reference", num_kv_blocks=10, block_size=4, max_model_len=40,
                async_scheduling=async_scheduling)
    cramped = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]
    for out, spec in zip(cramped, specs):
        check(spec, out.outputs[0].text)


def test_a_grammar_that_cannot_finish_in_max_tokens_is_cut_at_length(llm):
    spec = StructuredOutputsParams(regex="a{30}b")
    out = llm.generate(["go"], SamplingParams(temperature=1.0, seed=1, max_tokens=5, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("aaaaa", "length")


def test_ignore_eos_still_ends_when_the_grammar_does(llm):
    spec = StructuredOutputsParams(choice=CHOICES)
    out = llm.generate(["go"], SamplingParams(temperature=1.0, seed=2, max_tokens=50, ignore_eos=True,
                                              structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_min_tokens_past_the_grammars_end_ends_the_completion(llm):
    """min_tokens bans the EOS that a finished grammar allows alone: the row has no allowed token, and the
    completion ends there (with a warning) instead of running on outside the grammar."""
    spec = StructuredOutputsParams(choice=["ok"])
    out = llm.generate(["go"], SamplingParams(temperature=0, max_tokens=20, min_tokens=5, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith("ok") and len(out.token_ids) == 3
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks and not llm.llm_engine.grammar_seqs


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "foo"}), r"structured_outputs\.json: invalid JSON schema: .*foo"),
    (dict(regex="a("), r"structured_outputs\.regex: invalid regex: .*parenthesis"),
    (dict(grammar="root ::= undefined_rule"), r"structured_outputs\.grammar: invalid grammar: .*undefined_rule"),
])
def test_invalid_specs_are_value_errors_before_scheduling(llm, spec, message):
    engine = llm.llm_engine
    free = engine.num_free_blocks()
    for _ in range(2):  # the second time from the cache: the same error
        with pytest.raises(ValueError, match=message):
            llm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)),
                         use_tqdm=False)
        assert not engine.requests and not engine.scheduler.has_unfinished() and engine.num_free_blocks() == free
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=SPECS[4]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES and engine.num_free_blocks() == free


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of.*regex, choice"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", 1]), "choice must be a non-empty list"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(json=[1, 2]), "must be a JSON schema"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(json_object=True, whitespace_pattern=" *"), "whitespace_pattern is not supported"),
])
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_each_distinct_spec_compiles_once(llm):
    grammars = Grammars(llm.get_tokenizer(), llm.llm_engine.vocab_size, llm.llm_engine.eos_token_ids)
    calls = []
    compile_ = grammars._compile
    grammars._compile = lambda compiler, spec: calls.append(spec.key()) or compile_(compiler, spec)
    reordered = dict(PERSON, properties=dict(reversed(PERSON["properties"].items())))  # another output order
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=json.dumps(PERSON, indent=2)),
             StructuredOutputsParams(json=reordered), StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
             StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(regex=REGEX)]
    for spec in specs * 2:
        grammars.compile(spec)
    assert len(calls) == 4  # PERSON (as dict or string), reordered, compact, the regex
    future = grammars.submit(StructuredOutputsParams(choice=["x", "y"]))
    future.result()
    assert len(calls) == 5 and grammars.submit(StructuredOutputsParams(choice=["x", "y"])) is None


def test_without_xgrammar_the_error_names_the_extra(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    engine = llm.llm_engine
    monkeypatch.setattr(engine, "grammars", Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids))
    with pytest.raises(ValueError, match=r"pip install 'flexengine\[structured\]'"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), use_tqdm=False)
    assert not engine.requests and engine.num_free_blocks() == engine.num_total_blocks
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_grammar_requests_are_not_decoded_by_multi_step():
    assert multi_step_ok(SamplingParams())
    assert not multi_step_ok(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))


def xgrammar_masked(logits, rows, bitmask, T):
    """xgrammar.apply_token_bitmask_inplace on the grammar rows `rows` of `logits` (bitmask: theirs), every other
    row unmasked, then the ids past the tokenizer's (T) banned in the grammar rows, as the engine does."""
    N, V = logits.shape
    W = bitmask.shape[1]
    # xgrammar's CPU kernel (0.2.8) corrupts the heap past logits whose width is not a multiple of 32 (one
    # more reason the sampler unpacks the bits itself): give it whole words, and no words past the vocabulary
    words = -(-V // 32)
    want = torch.cat([logits, torch.zeros(N, words * 32 - V, device=logits.device)], dim=1)
    full = torch.full((N, words), -1, dtype=torch.int32, device=logits.device)
    full[rows] = torch.cat([bitmask, torch.full((len(rows), max(0, words - W)), -1, dtype=torch.int32,
                                                device=logits.device)], dim=1)[:, :words]
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=V)
    want = want[:, :V]
    if T < V:  # past the tokenizer's ids
        want[torch.as_tensor(rows)[:, None], torch.arange(T, V)[None, :]] = float("-inf")
    return want


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(V=st.integers(1, 100), N=st.integers(1, 5), data=st.data())
def test_token_mask_matches_xgrammars_own(V, N, data):
    """The sampler's bit unpacking against xgrammar.apply_token_bitmask_inplace, on some rows of a batch,
    with a bitmask wider than the logits (the tokenizer's padding) or narrower (a model's padded
    embeddings: the ids past the tokenizer's are not allowed), and a tokenizer vocabulary `T` that ends inside
    the last word (its bits past T are set at random, as xgrammar leaves them)."""
    rows = sorted(data.draw(st.sets(st.integers(0, N - 1), min_size=1)))
    W = data.draw(st.integers(max(1, -(-V // 32) - 2), -(-V // 32) + 2))
    T = data.draw(st.integers(32 * W - 31, 32 * W))
    seed = data.draw(st.integers(0, 2 ** 31))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), W), dtype=torch.int32, generator=g)
    want = xgrammar_masked(logits, rows, bitmask, T)
    m = token_mask(N, rows, bitmask, T)
    assert torch.equal(apply_token_mask(logits, m.bitmask, m.limit), want)


def test_a_model_vocabulary_larger_than_the_tokenizers(llm, tmp_path):
    """Ids past the tokenizer's (padded embeddings) are never allowed, even where the model favours them."""
    from safetensors.torch import load_file, save_file
    src = llm.llm_engine.runner.model_path
    dst = tmp_path / "padded"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    old, new = config["vocab_size"], config["vocab_size"] + 37
    config["vocab_size"] = new
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(os.path.join(dst, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        extra = torch.randn(new - old, w.shape[1], generator=g) * (20.0 if name == "lm_head.weight" else 1.0)
        weights[name] = torch.cat([w, extra])
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    padded = LLM(str(dst), seed=0, attention_backend="reference", num_kv_blocks=64)
    free = padded.generate(["abc"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert any(t >= old for t in free.token_ids), "the setup should make the padded ids likely"
    # a free string allows every token the tokenizer has: xgrammar then fills whole words of ones, past its
    # vocabulary too (the H100 run of session 17 sampled such ids inside JSON strings)
    text = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}}, "required": ["s"],
            "additionalProperties": False}
    for spec in (StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(json=text)):
        outs = padded.generate(["abc"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                            structured_outputs=spec) for s in range(3)], use_tqdm=False)
        for out in outs:
            c = out.outputs[0]
            assert all(t < old or t in padded.llm_engine.eos_token_ids for t in c.token_ids), c.token_ids
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(spec, c.text)


def test_multi_step_and_cuda_graph_paths(gpu_shaped_engines):
    """The engine's CUDA-graph step paths (decode and mixed graphs, run eagerly on CPU) with
    num_scheduler_steps=4: grammar rows get their masks there too, no multi-step batch holds one, and the
    unconstrained requests' tokens equal a run without grammar neighbours (which multi-step decodes)."""
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=48, max_model_len=96, num_scheduler_steps=4)
    engine = llm.llm_engine
    multi = []
    execute = engine.runner.execute_multi_step
    engine.runner.execute_multi_step = lambda batch: multi.append(batch.seqs) or execute(batch)
    prompts, params = unconstrained_requests(max_tokens=10)
    prompts, params = [p[:6] for p in prompts[:3]], params[:3]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert multi, "the unconstrained run should decode several steps at a time"
    specs = [SPECS[3], SPECS[4]]
    grammar = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, structured_outputs=s) for i, s in enumerate(specs)]
    multi.clear()
    outs = llm.generate(prompts + ["g0", "g1"], params + grammar, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    for out, spec in zip(outs[3:], specs):
        assert out.outputs[0].finish_reason == "stop"
        check(spec, out.outputs[0].text)
    assert not any(s.grammar is not None for seqs in multi for s in seqs)
    assert engine.num_free_blocks() == engine.num_total_blocks


def test_throughput_benchmark_with_json_schemas(capsys, tmp_path):
    from flexengine import cli
    out_json = tmp_path / "s.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "24",
                     "--json-schemas", "2", "--attention-backend", "reference", "--num-kv-blocks", "32", "--json-out", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Ratio constrained / unconstrained, both rounds: [0-9.]+$", out, re.M), out
    assert re.search(r"^Grammar compile \(first request of each schema\): first [0-9.]+ ms", out, re.M), out
    result = json.loads(out_json.read_text())
    assert result["json_schemas"] == 2 and len(result["compile_s"]) == 2 and 0 < result["output_tokens"] <= 2 * 4 * 24
    assert len(result["rounds"]) == 2 and sum(r["output_tokens"] for r in result["rounds"]) == result["output_tokens"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_token_mask_on_cuda_matches_xgrammars_kernel():
    """The CUDA engine's token masks (through Inductor) against xgrammar's CUDA kernel: the pointwise mask
    (Sampler.mask) and the one the sampling kernel applies as it reads (greedy rows of temperature_sample)."""
    from flexengine.layers.sampler import temperature_sample
    from flexengine.compile import fused_elementwise
    g = torch.Generator(device="cuda").manual_seed(0)
    for V in (32, 4000, 32 * 4008):  # a 128k vocabulary's width among them
        W = V // 32
        logits = torch.randn(6, V, device="cuda", generator=g)
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, W), dtype=torch.int32, device="cuda", generator=g)
        rows = [0, 2, 5]
        want = xgrammar_masked(logits, rows, bitmask, V)
        m = token_mask(6, rows, bitmask, V)
        assert torch.equal(apply_token_mask(logits.clone(), m.bitmask, m.limit), want)
        with torch.inference_mode():  # the CUDA engine's way: through Inductor
            assert torch.equal(Sampler(compiled=True).mask(logits.clone(), m), want)
            with fused_elementwise(True):
                greedy = temperature_sample(logits.clone(), torch.zeros(6, device="cuda"),
                                            torch.ones(6, V, device="cuda"), (m.bitmask, m.limit))
            assert torch.equal(greedy, want.argmax(-1))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("flags", [dict(async_scheduling=True), dict(num_scheduler_steps=4)])
def test_grammar_requests_on_the_cuda_graph_engine(flags):
    """The real CUDA-graph engine (decode and mixed graphs), with async scheduling or multi-step decode:
    grammar outputs validate and the unconstrained greedy outputs equal those run alone."""
    llm = LLM(seed=0, max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=256, **flags)
    prompts, params = unconstrained_requests(max_tokens=32)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    specs = SPECS[:1] + SPECS[2:]
    grammar = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=200, structured_outputs=s)
               for i, s in enumerate(specs)]
    outs = llm.generate(prompts + [f"g{i}" for i in range(len(specs))], params + grammar, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:len(prompts)]] == alone
    for out, spec in zip(outs[len(prompts):], specs):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            check(spec, c.text)
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks
