"""Decode CUDA graphs: the static-buffer step equals the ordinary step; on a GPU, graphs == eager."""
import dataclasses
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from flexengine import LLM, SamplingParams
from flexengine.compile import compile_count
from flexengine.compile import decode_buckets
from flexengine.compile.cuda_graphs import DecodeGraphRunner
from flexengine.compile.mixed_graphs import MixedGraphRunner, MixedKey
from flexengine.engine.decode_inputs import pack_decode
from flexengine.engine.scheduler import ScheduledBatch
from flexengine.engine.sequence import Sequence


def test_buckets():
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]
    assert decode_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 300]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20] and decode_buckets(1) == [1]


def test_buckets_without_the_ones_between_powers(monkeypatch):
    """compile/policy.py's knobs for a start-up A/B: no 96, and past 128 a bucket every 128 rows."""
    from flexengine.compile import policy
    monkeypatch.setattr(policy, "DECODE_BUCKET_96", False)
    monkeypatch.setattr(policy, "DECODE_BUCKET_STEP", 128)
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def fake_seq(i, n, pages):
    s = Sequence(request_id=str(i), index=0, token_ids=[(7 * i + j) % 200 + 1 for j in range(n)],
                 num_prompt_tokens=n, params=None)
    s.block_table, s.num_computed_tokens = pages, n - 1
    return s


def cpu_decode_graphs(r, max_num_seqs: int) -> DecodeGraphRunner:
    """The decode-graph runner over an eager CPU runner's model and cache, run without graphs."""
    P = r.block_size
    return DecodeGraphRunner(r.forward_logits, r.backend, r.mods, max_num_seqs=max_num_seqs, block_size=P,
                             num_blocks=r.num_blocks + 1, table_width=r.table_width, num_kv_heads=r.num_kv_heads,
                             params={}, scratch_slot=r.num_blocks * P, device="cpu")


def test_static_buffer_decode_matches_the_ordinary_step():
    """The captured function, run eagerly: padded rows (bucket 4 for 3 requests), reused buffers."""
    llm = LLM(block_size=8, num_kv_blocks=32, enforce_eager=True)
    r = llm.llm_engine.runner
    llm.generate(["warm the cache up"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    g = cpu_decode_graphs(r, max_num_seqs=4)
    for seqs in ([fake_seq(0, 20, [3, 9, 4]), fake_seq(1, 5, [7]), fake_seq(2, 9, [12, 1])],
                 [fake_seq(3, 1, [5])]):
        with torch.inference_mode():
            inputs = r.prepare_step(ScheduledBatch(seqs, [1] * len(seqs)))
            expected = r.forward_logits(inputs.input_ids, inputs.positions, inputs.meta)
            got = g.run(pack_decode(seqs, r.block_size, columns=g.bufs.max_bs), len(seqs), {})
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_moved_on_matches_the_ordinary_step():
    """Steady decode: the graphs' buffers move on by themselves and take only the new pages (decode_inputs.py),
    also when requests left or the rest come in another order (each row gathered from its place). Each step's logits
    equal the ordinary step's, across page boundaries; a batch with a new request is packed whole."""
    llm = LLM(block_size=4, num_kv_blocks=32, enforce_eager=True)
    r = llm.llm_engine.runner
    llm.generate(["warm the cache up"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    r.decode_graphs = cpu_decode_graphs(r, max_num_seqs=4)
    graphs_moved, run_moved_on = [], r.decode_graphs.run_moved_on
    r.decode_graphs.run_moved_on = lambda *a: graphs_moved.append(1) or run_moved_on(*a)
    seqs = [fake_seq(0, 6, [3, 9]), fake_seq(1, 3, [7]), fake_seq(2, 8, [12, 1]), fake_seq(3, 5, [13, 14])]
    free, moved = iter(range(20, 32)), []
    for step in range(7):
        if step == 3:
            seqs = [seqs[3], seqs[0], seqs[2]]  # one left, the rest in another order
        if step == 5:
            seqs = seqs[1:]
        with torch.inference_mode():
            inputs = r.prepare_step(ScheduledBatch(seqs, [1] * len(seqs)))
            expected = r.forward_logits(inputs.input_ids, inputs.positions, inputs.meta)
            calls = len(graphs_moved)
            got = r.decode_from_graphs(seqs, None).clone()
            moved.append(len(graphs_moved) > calls)
            # the same step packed whole (writing what the moved buffers hold): exactly the same logits
            assert torch.equal(got, r.run_decode_graph(seqs)), step
        # (float32 on the CPU: the padded bucket's GEMMs round a few logits ~3e-5 apart from the unpadded step's)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for s in seqs:  # one token on; a new page where the next position starts one
            s.token_ids.append((5 * step + s.num_tokens) % 200 + 1)
            s.num_computed_tokens += 1
            if (s.num_tokens - 1) // 4 >= len(s.block_table):
                s.block_table.append(next(free))
    assert moved == [False] + [True] * 6
    assert r.decode_tracker.next_step(seqs + [fake_seq(4, 3, [15])]) is None  # a new request: packed whole


def chunk_seq(i, n, computed, pages):
    """A request with `computed` of its n tokens in the cache; the step computes the rest."""
    s = fake_seq(i, n, pages)
    s.num_computed_tokens = computed
    return s


def test_static_buffer_mixed_step_matches_the_ordinary_step():
    """The mixed-graph function, run eagerly: prompt chunks next to decode rows, tokens padded to the
    key's capacity (padding writes the scratch page), one key's buffers reused by a second step."""
    llm = LLM(block_size=8, num_kv_blocks=32, enforce_eager=True)
    r = llm.llm_engine.runner
    g = MixedGraphRunner(r.run_model, r.backend, r.mods, rows=3, table_width=r.table_width, block_size=8,
                         num_blocks=r.num_blocks + 1, params={}, scratch_slot=r.num_blocks * 8, device="cpu",
                         num_kv_heads=r.num_kv_heads)
    steps = [  # (sequences, new tokens each)
        ([chunk_seq(0, 20, 19, [3, 9, 4]), chunk_seq(1, 30, 0, [7, 2, 5, 6]), chunk_seq(2, 9, 8, [12, 1])], [1, 30, 1]),
        ([chunk_seq(3, 12, 11, [8, 10]), chunk_seq(4, 25, 17, [11, 13, 14, 15]), chunk_seq(5, 4, 3, [16])], [1, 8, 1]),
        ([chunk_seq(6, 140, 0, list(range(14, 32))), chunk_seq(7, 2, 1, [0]), chunk_seq(8, 50, 40, list(range(1, 8)))],
         [140, 1, 10]),
    ]
    # past max_tiles only the plan and the metadata come from the runner (a graph of their own on CUDA), the model
    # runs on them eagerly: the 140-token chunk's two tiles here
    planned = MixedGraphRunner(r.run_model, r.backend, r.mods, rows=3, table_width=r.table_width, block_size=8,
                               num_blocks=r.num_blocks + 1, params={}, scratch_slot=r.num_blocks * 8, device="cpu",
                               num_kv_heads=r.num_kv_heads, max_tiles=1, plan_tiles=2)
    keys = set()
    for seqs, new in steps:
        batch = ScheduledBatch(seqs, new)
        with torch.inference_mode():
            inputs = r.prepare_step(batch)
            expected = r.run_model(inputs.input_ids, inputs.positions, inputs.meta)
            p = r.pack_step(batch)
            key = MixedKey.of(p.layout)
            query_lens = p.query_lens  # (this runner's rows: the step's three requests)
            for runner in (g, planned):
                assert runner.fits(key) and runner.whole(key) == (runner is g or key.num_tiles == 1)
                got = runner.run(p.ids[: len(inputs.input_ids)], query_lens, p.seq_lens, p.tables, key, {})
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        keys.add(key)
    assert len(keys) < len(steps), "no step reused a key's buffers"
    assert any(k.num_tiles == 2 for k in keys), "no step took the plan-only path"
    assert not planned.fits(dataclasses.replace(key, num_tiles=4)), "a key past the plan's capacity"
    # a key past the device plan's capacity (split rows chosen again from the environment) runs without a graph
    assert not g.fits(dataclasses.replace(key, num_decode=g.capacity.decode_requests + 1))
    assert not g.fits(dataclasses.replace(key, splits=g.capacity.decode_rows + 1, num_decode=1))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_graphs_equal_eager_and_no_recompiles_after_warm_up(monkeypatch):
    import random
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 250) for _ in range(rng.randint(1, 300))]} for _ in range(300)]
    lengths = [rng.randint(1, 40) for _ in prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    graphed = LLM(max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=4096, attention_backend="flex")
    assert graphed.llm_engine.runner.decode_graphs is not None
    before = compile_count()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out_graphs = graphed.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    # No step allocates anything the size of a layer's cache: torch 2.11's Inductor once copied each layer's
    # whole K and V cache around the fused K/V write (an OOM at capture on a full-size cache)
    layer_cache = graphed.llm_engine.runner.layers[0].k_cache
    transient = torch.cuda.max_memory_allocated() - base
    assert transient < layer_cache.numel() * layer_cache.element_size(), (transient, layer_cache.shape)
    del graphed
    eager = LLM(max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=4096, enforce_eager=True,
                attention_backend="flex")
    out_eager = eager.generate(prompts, params, use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(out_graphs, out_eager))
    assert same == len(prompts), f"{len(prompts) - same} of {len(prompts)} requests differ between graphs and eager"
    del eager
    from flexengine.compile import mixed_graphs, warmup
    for flags, how, whole_tiles, at_start in (
            (dict(num_scheduler_steps=4), "with 4 steps per schedule", 16, True),
            (dict(async_scheduling=True), "with async scheduling, steps of 3-4 tiles from graphs of their plan "
             "and metadata alone", 2, True),
            (dict(async_scheduling=True), "with async scheduling, the plan graphs captured when first met", 2,
             False)):
        monkeypatch.setattr(mixed_graphs, "MAX_GRAPH_TILES", whole_tiles)
        monkeypatch.setattr(warmup, "CAPTURE_PLAN_GRAPHS", at_start)
        llm = LLM(max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=4096, attention_backend="flex", **flags)
        assert bool(llm.llm_engine.runner.mixed_graphs.plan_graphs) == (whole_tiles < 4 and at_start)
        before = compile_count()
        out = llm.generate(prompts, params, use_tqdm=False)
        assert compile_count() == before, f"a shape compiled after warm-up ({how})"
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(out_graphs, out))
        assert same == len(prompts), f"{len(prompts) - same} of {len(prompts)} requests differ {how}"
        assert bool(llm.llm_engine.runner.mixed_graphs.plan_graphs) == (whole_tiles < 4)
        del llm


def test_fused_elementwise_matches_eager():
    """The compiled norm / rotary / activation kernels the CUDA engine uses, checked on CPU."""
    from flexengine.compile import reset_fused, set_fused_elementwise
    reset_fused()  # compile here, with Inductor
    from flexengine.layers.activation import act_and_mul
    from flexengine.layers.norms import rms_norm
    from flexengine.layers.rotary import apply_rotary
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 8, generator=g), torch.randn(8, generator=g)
    cos, sin = torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g)
    cases = [(rms_norm, (x, w, 1e-6, False)), (rms_norm, (x, w, 1e-5, True)), (apply_rotary, (x, cos, sin)),
             (act_and_mul, (x, "silu")), (act_and_mul, (x, "gelu_pytorch_tanh"))]
    set_fused_elementwise(True)
    try:
        for fn, args in cases:
            torch.testing.assert_close(fn(*args), fn.eager(*args), atol=1e-5, rtol=1e-5)
    finally:
        set_fused_elementwise(False)


@pytest.mark.parametrize("combo_env", ["", "0"])
def test_decode_regions_compile_their_own_version(monkeypatch, combo_env):
    """Inside decode_regions a `fused` function runs a version of its own (Inductor's combo kernels, which slowed
    prefill), equal to eager; outside it, the plain one; FLEXENGINE_COMBO_KERNELS=0 leaves one version only."""
    from flexengine.compile import fused_elementwise, reset_fused
    from flexengine.compile.policy import decode_regions
    from flexengine.layers.rotary import apply_rotary
    monkeypatch.setenv("FLEXENGINE_COMBO_KERNELS", combo_env)
    reset_fused()
    g = torch.Generator().manual_seed(1)
    x, cos, sin = torch.randn(3, 2, 8, generator=g), torch.randn(3, 1, 4, generator=g), torch.randn(3, 1, 4, generator=g)
    with fused_elementwise(True):
        torch.testing.assert_close(apply_rotary(x, cos, sin), apply_rotary.eager(x, cos, sin))
        with decode_regions():
            torch.testing.assert_close(apply_rotary(x, cos, sin), apply_rotary.eager(x, cos, sin))
    assert sorted(apply_rotary.compiled) == ([False, True] if combo_env == "" else [False])
    reset_fused()


def mixed_traffic(n=14, seed=0, max_len=90, max_tokens=12, **params):
    import random
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 250) for _ in range(rng.randint(1, max_len))]} for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=rng.randint(1, max_tokens), ignore_eos=True, **params) for _ in prompts]


@pytest.mark.parametrize("enforce_eager, combo_up_to, block_size, whole_tiles",
                         [(False, 1, None, 16), (False, 4, None, 16), (True, 1, None, 16), (False, 1, 128, 16),
                          (False, 1, 128, 0)])
def test_static_shape_steps_never_recompile_after_warm_up(gpu_shaped_engines, enforce_eager, combo_up_to, block_size,
                                                         whole_tiles, monkeypatch):
    """The CUDA engine's shape policy, checked on CPU: after the warm-up (the decode buckets compiled
    by the capture, or by the warm-up under enforce_eager), mixed prefill/decode traffic adds no
    graph, and gives the tokens the plain CPU engine gives; also with the regions' combo version in every decode
    bucket (cuda_graphs.COMBO_UP_TO: one more dynamic compile, made by the capture), and with the GPU's 128-token
    pages, which prefill reads in place (no workspace copy); and with no whole mixed graph (whole_tiles 0: every step
    with prompt tokens replays only its plan and metadata, then runs the model eagerly, as past 16 tiles on a GPU)."""
    from flexengine.compile import cuda_graphs, mixed_graphs
    monkeypatch.setattr(cuda_graphs, "COMBO_UP_TO", combo_up_to)
    monkeypatch.setattr(mixed_graphs, "MAX_GRAPH_TILES", whole_tiles)
    combo = set()  # whether each decode bucket's step ran the regions' combo version
    regions = cuda_graphs.decode_regions
    monkeypatch.setattr(cuda_graphs, "decode_regions", lambda on: combo.add(on) or regions(on))
    prompts, params = mixed_traffic(temperature=0)
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=128, block_size=block_size)
    before_build = compile_count()
    static = LLM(**config, enforce_eager=enforce_eager)
    runner = static.llm_engine.runner
    assert runner.static_shapes and (runner.decode_graphs is None) == enforce_eager
    assert runner.backend.direct(runner.block_size, runner.device) == (block_size == 128)
    assert compile_count() > before_build
    layer = runner.model.model.layers[0]  # the regions' versions: combo (batch 1, or up to COMBO_UP_TO) and plain
    assert set(type(layer).attention_inputs.compiled) == (set() if enforce_eager else {True, False})
    assert combo == (set() if enforce_eager else {True} if combo_up_to == 4 else {True, False})  # buckets 1, 2, 4
    ran = []  # the mixed steps' keys
    if not enforce_eager:
        run = runner.mixed_graphs.run
        runner.mixed_graphs.run = lambda *a, **kw: ran.append(a[4]) or run(*a, **kw)
    before = compile_count()
    got = static.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    assert {runner.mixed_graphs.whole(k) for k in ran} == (set() if enforce_eager else {whole_tiles > 0})
    if whole_tiles == 0 and block_size == 128:
        # a plan-only key's pool-wide page lists are views of the runner's one set of buffers (a set per key's graph
        # would stay allocated with it), and the compiled kernels took them without a compile (above)
        graphs = runner.mixed_graphs
        key = next(k for k in ran if k.num_decode)
        with torch.inference_mode():
            meta = graphs.plan(key)[2]
        (mask,) = graphs.kept_lists
        decode, prefill = meta.backend_state["masks"][mask]
        kept = graphs.kept_lists[mask]
        assert [m.data_ptr() for m in (decode.kv_indices, decode.full_kv_indices, prefill.kv_indices,
                                       prefill.full_kv_indices)] == [kept[name].data_ptr() for name in kept]
    gpu_shaped_engines()
    plain = LLM(**config, enforce_eager=True)
    assert not plain.llm_engine.runner.static_shapes
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_decode_with_heads_as_rows_compiles_nothing_after_warm_up(gpu_shaped_engines, monkeypatch):
    """flex_kernels.DECODE_HEADS_AS_ROWS on the CUDA engine's path on the CPU: the decode rows of steps with up to 4
    (decode-only and mixed) run flex's attention template with each KV head's query heads as its rows; the warm-up
    compiles them, mixed traffic adds no graph, and the tokens are the plain engine's."""
    from flexengine.attention.backends import flex, flex_kernels
    monkeypatch.setattr(flex_kernels, "DECODE_HEADS_AS_ROWS", 4)
    monkeypatch.setattr(flex_kernels, "HEADS_AS_ROWS_ON_CPU", True)
    groups = []  # the query heads per KV head of each step that took it
    made = flex.FlexBackend.heads_as_rows_mods
    monkeypatch.setattr(flex.FlexBackend, "heads_as_rows_mods", lambda self, *a: groups.append(a[-1]) or made(self, *a))
    prompts, params = mixed_traffic(temperature=0)
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=128)
    static = LLM(**config)
    assert static.llm_engine.runner.static_shapes
    before, warm_up = compile_count(), len(groups)
    got = static.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    assert warm_up > 0 and len(groups) > warm_up and min(groups) > 1, groups  # (the tiny model's GQA: groups of 2+)
    gpu_shaped_engines()
    expected = LLM(**config, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_symbolic_decode_rows_and_prefill_tiles_compile_once_past_the_first_bucket(gpu_shaped_engines, monkeypatch):
    """flex_kernels.DECODE_DYNAMIC and PREFILL_DYNAMIC on the CUDA engine's path on the CPU (dynamo's eager backend):
    the unsplit decode rows (query heads as rows) and the prefill tiles each compile one static graph for their first
    bucket and one symbolic graph that serves the buckets after it (dynamo specialises size 1: a graph of its own),
    mixed traffic adds none, and the tokens are the plain engine's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from flexengine.attention.backends import flex_kernels
    from flexengine.compile.warmup import prefill_buckets
    monkeypatch.setattr(flex_kernels, "DECODE_DYNAMIC", True)
    monkeypatch.setattr(flex_kernels, "PREFILL_DYNAMIC", True)
    monkeypatch.setattr(flex_kernels, "SYMBOLIC_ON_CPU", True)
    monkeypatch.setattr(flex_kernels, "HEADS_AS_ROWS_ON_CPU", True)
    prompts, params = mixed_traffic(n=20, temperature=0)
    config = dict(max_num_seqs=16, max_num_batched_tokens=640, num_kv_blocks=96, max_model_len=128)
    static = LLM(**config)
    assert len(static.llm_engine.runner.decode_buckets) >= 5 and len(prefill_buckets(static.llm_engine.runner)) >= 3
    graphs = {fn.__name__: len(_debug_get_cache_entry_list(fn.__code__))
              for fn in (flex_kernels.flex_for_decode, flex_kernels.flex_for_prefill)}
    assert 1 <= graphs["flex_for_decode"] <= 3 and 1 <= graphs["flex_for_prefill"] <= 3, graphs
    before = compile_count()
    got = static.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    gpu_shaped_engines()
    expected = LLM(**config, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def symbolic_path_config(block_size: int) -> dict:
    """An engine whose prefill buckets start at one tile, over a workspace (16-token pages) or in place (128)."""
    return dict(max_num_seqs=16, max_num_batched_tokens=640, block_size=block_size,
                num_kv_blocks=96 * 16 // block_size, max_model_len=128 if block_size == 16 else 384)


@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_call_compiled_symbolic_from_its_first_call_is_one_graph(gpu_shaped_engines, monkeypatch, block_size):
    """flex_kernels.PREFILL_SYMBOLIC_FIRST on the CUDA engine's path on the CPU (dynamo's eager backend), over a
    workspace (16-token pages) and in place (128-token pages): the prefill call's first compile takes its tile count
    symbolic, a one-tile step's call two tiles (the second empty), so every prefill bucket runs on one graph where
    automatic dynamic shapes made two; traffic compiles nothing after warm-up (at 128-token pages a mixed step's
    decode rows once compiled again: the prefill call's static marks had been put on the K and V they take too), and
    the tokens are the eager engine's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from flexengine.attention.backends import flex_kernels
    from flexengine.compile.warmup import prefill_buckets
    monkeypatch.setattr(flex_kernels, "PREFILL_DYNAMIC", True)
    monkeypatch.setattr(flex_kernels, "PREFILL_SYMBOLIC_FIRST", True)
    monkeypatch.setattr(flex_kernels, "SYMBOLIC_ON_CPU", True)
    prompts, params = mixed_traffic(n=16, temperature=0)
    config = symbolic_path_config(block_size)
    static = LLM(**config)
    assert prefill_buckets(static.llm_engine.runner)[0] == 1 and len(prefill_buckets(static.llm_engine.runner)) >= 3
    assert len(_debug_get_cache_entry_list(flex_kernels.flex_for_prefill.__code__)) == 1
    before = compile_count()
    got = static.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    assert len(_debug_get_cache_entry_list(flex_kernels.flex_for_prefill.__code__)) == 1
    gpu_shaped_engines()
    expected = LLM(**config, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def strict_mask(rows: int, max_len: int, heads: int):
    """Causal, and raises (an index past a one-element tensor) on a request index past `rows` or a coordinate
    outside [0, max_len): what an attention-gym mod indexing its captured tables would do. (test_gym_mods' strict
    mask reads the lengths as a per-request parameter, which LLM's check of a mod at its construction, with
    parameters of 1, refuses: this one captures them.)"""
    guard, length = torch.zeros(1, dtype=torch.bool), torch.full((rows,), max_len)

    def strict(b, h, q_idx, kv_idx):
        L = length[b]
        bad = (q_idx < 0) | (q_idx >= L) | (kv_idx < 0) | (kv_idx >= L) | (h < 0) | (h >= heads)
        return guard[bad.long()] | (kv_idx <= q_idx)
    return strict


@pytest.mark.parametrize("block_size", [16, 128])
def test_the_gpu_paths_padding_never_reaches_a_strict_mod(gpu_shaped_engines, monkeypatch, block_size):
    """The CUDA engine's path on the CPU with the symbolic prefill call (a one-tile step's call padded to two tiles,
    padding rows, decode buckets, 128-token pages read in place): a mask mod that raises on any coordinate outside
    [0, max_model_len) or past the batch's rows is never called there (with the padding rows' positions set past
    max_len instead of a live token's, this fails), compiles nothing after warm-up, and gives the reference
    backend's tokens."""
    from flexengine.attention.backends import flex_kernels
    monkeypatch.setattr(flex_kernels, "SYMBOLIC_ON_CPU", True)
    prompts, params = mixed_traffic(n=16, temperature=0)
    config = symbolic_path_config(block_size)
    config["mask_mod"] = strict_mask(config["max_num_seqs"], config["max_model_len"], 4)
    static = LLM(**config)
    before = compile_count()
    got = static.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    gpu_shaped_engines()
    expected = LLM(**config, attention_backend="reference").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("flash", [False, True])
def test_the_prefill_call_is_padded_exactly_where_it_runs_symbolic(gpu_shaped_engines, monkeypatch, flash):
    """The CUDA engine's path on the CPU at 128-token pages (one-tile steps): a one-tile step's prefill call takes a
    second, empty tile where the call is the symbolic one (the Triton kernel), and its own one tile where the kernel
    compiles per bucket (`flash`: the prefill kernel reported as FA4's, as on an H200 at head size > 64; the call
    itself still runs Triton's template here). Every call's rows match the lists it was given, and the tokens are the
    reference backend's. Padding decided by the device alone (sessions 52-53) fails the FA4 case."""
    from flexengine.attention.backends import flex, flex_kernels, prefill_kernel
    from flexengine.attention.layout import Q_TILE
    monkeypatch.setattr(flex_kernels, "SYMBOLIC_ON_CPU", True)
    monkeypatch.setattr(prefill_kernel.PrefillKernel, "serves_flash", lambda self: flash)
    calls = []  # (the layout's tiles, the call's q rows, the BlockMask's q blocks, whether it ran symbolic)
    prefill = flex.FlexBackend.prefill

    def recorded(self, fn, q, k, v, score_mod, block_mask, scale, gqa, meta):
        calls.append((meta.layout.num_tiles, q.shape[2], block_mask.kv_num_blocks.shape[2],
                      meta.backend_state["symbolic_prefill"]))
        return prefill(self, fn, q, k, v, score_mod, block_mask, scale, gqa, meta)
    monkeypatch.setattr(flex.FlexBackend, "prefill", recorded)
    prompts, params = mixed_traffic(n=16, temperature=0)
    config = symbolic_path_config(128)
    static = LLM(**config)
    calls.clear()
    got = static.generate(prompts, params, use_tqdm=False)
    assert any(tiles == 1 for tiles, *_ in calls) and any(tiles > 1 for tiles, *_ in calls), calls
    for tiles, rows, blocks, symbolic in calls:
        assert symbolic == (not flash), calls
        padded = 2 if symbolic and tiles == 1 else tiles
        assert rows == padded * Q_TILE and blocks == padded, (tiles, rows, blocks, symbolic)
    gpu_shaped_engines()
    expected = LLM(**config, attention_backend="reference").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_decode_graph_helpers_compile_no_graph_of_their_own_for_one_row(gpu_shaped_engines, monkeypatch):
    """The decode graphs' helpers as the CUDA engine compiles them (compile.compiled_on_first_use), here under dynamo's
    eager backend, over buckets 16 to 1: take_decode_inputs takes two rows at batch 1 and the one-row bucket's layout
    has a padding span (cuda_graphs.decode_layout), so neither its inputs nor its positions get a graph for one row
    (dynamo specialises a size of 1: a graph more each on an H200's fresh start, session 48), nor the page lists (they
    list a row more than they are read: session 50). Mixed traffic, whose batches shrink to one request, gives
    the eager engine's tokens and compiles nothing after warm-up."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from harness import decode_graph_helpers
    helpers = [(module, name, compiled) for name, (module, compiled) in decode_graph_helpers().items()]
    plain = [getattr(module, name) for module, name, _ in helpers]
    for module, name, compiled in helpers:
        compiled.cache_clear()
        monkeypatch.setattr(module, name, compiled())  # (the CPU's call sites take the plain function)
    try:
        prompts, params = mixed_traffic(n=12, temperature=0)
        config = dict(max_num_seqs=16, max_num_batched_tokens=640, num_kv_blocks=96, max_model_len=128)
        static = LLM(**config)
        assert static.llm_engine.runner.decode_buckets[0] == 1
        graphs = [len(_debug_get_cache_entry_list(fn.__code__)) for fn in plain]
        assert graphs == [1, 1], graphs
        before = compile_count()
        got = static.generate(prompts, params, use_tqdm=False)
        assert compile_count() == before, "a shape compiled after warm-up"
    finally:
        for _, _, compiled in helpers:
            compiled.cache_clear()
    gpu_shaped_engines()
    expected = LLM(**config, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_zero_first_deltas_put_the_first_layer_on_the_later_layers_graphs(gpu_shaped_engines, monkeypatch):
    """models/decoder.ZERO_FIRST_DELTAS: the first layer's zero additions run it on the later layers' graphs of
    attention_inputs: 3 (plain rows, the down projection's split rows, whose row test is made device-blind here so
    that the CPU takes them, and the batch-1 combo compile) where None made 5, and the tokens are exactly those of
    the None path (x + 0 + 0 is x), in bfloat16 over mixed traffic."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from flexengine.attention.backends import flex_kernels
    from flexengine.compile import reset_fused
    from flexengine.layers import linear
    from flexengine.models import decoder
    monkeypatch.setattr(decoder, "takes_down_split", lambda x: 1 < x.shape[0] <= linear.DOWN_SPLIT_ROWS)
    prompts, params = mixed_traffic(n=12, temperature=0)
    config = dict(max_num_seqs=64, max_num_batched_tokens=640, num_kv_blocks=200, max_model_len=128, dtype="bfloat16")
    graphs, tokens = {}, {}
    for zero in (False, True):
        monkeypatch.setattr(decoder, "ZERO_FIRST_DELTAS", zero)
        torch._dynamo.reset()
        reset_fused()
        flex_kernels.clear_compiled()
        out = LLM(**config).generate(prompts, params, use_tqdm=False)
        tokens[zero] = [o.outputs[0].token_ids for o in out]
        graphs[zero] = len(_debug_get_cache_entry_list(decoder.DecoderLayer.attention_inputs.eager.__code__))
    assert graphs == {False: 5, True: 3}, graphs
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_and_prompt_logprobs_compile_nothing_after_warm_up(gpu_shaped_engines, dtype):
    """The prompt-logprob scoring, in the model dtype (bfloat16 as on a GPU, and float32), is compiled by the
    warm-up, one graph for every row count; sampled logprobs stay eager. In float32 both give what the eager
    engine gives (in bfloat16 the padded and unpadded steps round apart)."""
    prompts, params = mixed_traffic(n=6, temperature=0, logprobs=2, prompt_logprobs=1)
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=128, dtype=dtype)
    static = LLM(**config)
    before = compile_count()
    got = static.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "the logprob scoring compiled after warm-up"
    if dtype != "float32":
        return
    gpu_shaped_engines()
    expected = LLM(**config, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_warm_up_covers_buckets_larger_than_the_pool(gpu_shaped_engines):
    """14 decodes land in bucket 16 though the pool has 12 pages: the warm-up must have compiled it."""
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=12, block_size=8, max_model_len=32,
              enforce_eager=True)
    before = compile_count()
    prompts = [{"prompt_token_ids": [i + 1, 2, 3]} for i in range(14)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert compile_count() == before


def test_start_up_shows_its_compile_work_under_progress_bars(gpu_shaped_engines, monkeypatch):
    """A machine's first start compiles for minutes: each of the warm-up's steps and each decode bucket's compile
    (on CUDA its capture, and the graphs of steps with prompt tokens) goes by as an item of a progress bar
    (compile.warmup.progress)."""
    from flexengine.compile import warmup
    bars, steps = {}, []
    shown, run_dummy = warmup.progress, warmup.run_dummy

    def recorded(runner, items, desc):
        bars[desc] = list(items)
        return shown(runner, bars[desc], desc)

    monkeypatch.setattr(warmup, "progress", recorded)
    monkeypatch.setattr(warmup, "run_dummy", lambda runner, seqs, n: steps.append(n) or run_dummy(runner, seqs, n))
    LLM(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, block_size=16)
    assert steps and bars["Compiling step shapes"] and len(bars["Compiling step shapes"]) == len(steps), (bars, steps)
    assert sorted(bars["Capturing decode CUDA graphs"]) == decode_buckets(8)


def test_progress_bars_show_on_a_terminal_of_the_first_rank_only(monkeypatch):
    """tqdm draws on a terminal (its disable=None), never into logs or pipes, and on tensor-parallel rank 0 only."""
    import io
    import sys
    from types import SimpleNamespace
    from flexengine.compile.warmup import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for rank, file, shows in ((0, Terminal(), True), (1, Terminal(), False), (0, io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", file)
        assert list(progress(SimpleNamespace(tp=SimpleNamespace(rank=rank)), [3, 1, 2], "Capturing")) == [3, 1, 2]
        assert ("Capturing" in file.getvalue() and "3/3" in file.getvalue()) == shows, (rank, file.getvalue())


def test_multi_step_decode_equals_one_step(gpu_shaped_engines):
    """num_scheduler_steps=4: decode steps run four at a time, each fed the last one's samples on the
    device. Seeded sampling, EOS stops mid-run, max_tokens and max_model_len cut-offs must give
    exactly the one-step tokens, with no page left allocated and no recompile."""
    prompts, params = mixed_traffic(n=10, max_len=60, max_tokens=40, temperature=0.8, top_k=20)
    for i, p in enumerate(params):
        p.seed = i
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=64)
    results = {}
    for steps in (1, 4):
        llm = LLM(**config, num_scheduler_steps=steps)
        engine = llm.llm_engine
        engine.eos_token_ids = frozenset(range(97, 104))  # a-g: some requests stop early
        for p in params:
            p.ignore_eos = False
        multi = []
        execute = engine.runner.execute_multi_step
        engine.runner.execute_multi_step = lambda batch: multi.append(batch.num_steps) or execute(batch)
        before = compile_count()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert compile_count() == before
        assert engine.num_free_blocks() == engine.num_total_blocks
        assert (max(multi, default=1) == 4) == (steps == 4) and all(k > 1 for k in multi)
        results[steps] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    assert results[4] == results[1]
    assert {r for _, r, _ in results[1]} == {"stop", "length"}
    capped = [len(p["prompt_token_ids"]) + len(t) == 64 < len(p["prompt_token_ids"]) + q.max_tokens
              for p, q, (t, _, _) in zip(prompts, params, results[1])]
    assert any(capped), "no request reached max_model_len"


def test_multi_step_decode_with_penalties_bias_and_min_tokens_equals_one_step(gpu_shaped_engines):
    """Repetition, frequency and presence penalties, logit_bias and min_tokens under num_scheduler_steps=4: each
    step of a pass sees the tokens the steps before it sampled (written on the device), so seeded sampling gives
    exactly the one-step tokens. Odd requests bias EOS (a-g below) far up, so that each stops as soon as
    min_tokens lets it; a pass that held EOS back for its later steps too would end them later."""
    prompts, params = mixed_traffic(n=8, max_len=40, max_tokens=30, temperature=0.9, repetition_penalty=1.3,
                                    frequency_penalty=0.6, presence_penalty=0.4)
    for i, p in enumerate(params):
        p.seed, p.logit_bias = i, {5: 2.0, 9: -3.0}
        if i % 2:
            p.ignore_eos, p.min_tokens = False, 2 + i % 5
            p.logit_bias.update({t: 12.0 for t in range(97, 104)})
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=64)
    results = {}
    for steps in (1, 4):
        llm = LLM(**config, num_scheduler_steps=steps)
        engine = llm.llm_engine
        engine.eos_token_ids = frozenset(range(97, 104))
        multi = []
        execute = engine.runner.execute_multi_step
        engine.runner.execute_multi_step = lambda batch: multi.append(batch.num_steps) or execute(batch)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert engine.num_free_blocks() == engine.num_total_blocks
        assert (max(multi, default=1) == 4) == (steps == 4)
        results[steps] = [o.outputs[0].token_ids for o in outs]
    assert results[4] == results[1]
    room = [min(p.max_tokens, 64 - len(q["prompt_token_ids"])) for q, p in zip(prompts, params)]  # max_model_len
    assert all(len(t) == (min(p.min_tokens + 1, n) if i % 2 else n)
               for i, (t, p, n) in enumerate(zip(results[1], params, room)))


@pytest.mark.parametrize("num_tokens", [5, 1])
def test_compiled_layer_regions_match_eager(num_tokens):
    """A decoder layer's two compiled regions (Inductor, here on CPU) against the same code run eagerly: the
    queries, the K/V the first writes into the paged cache, the second's output."""
    from flexengine.attention.kv_cache import allocate_kv_cache
    from flexengine.compile import reset_fused, set_fused_elementwise
    reset_fused()  # compile here, with Inductor, whatever an earlier test compiled them with
    model = LLM(num_kv_blocks=16, enforce_eager=True).llm_engine.runner.model
    layer, spec = model.model.layers[0], model.spec
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, spec.hidden_size, generator=g)
    o = torch.randn(num_tokens, spec.num_heads, spec.head_dim, generator=g)
    positions = torch.arange(num_tokens) * 7
    cos, sin = model.model.rotary[model.model.rope_key[layer.layer_type]](positions, x.dtype)
    attn = layer.self_attn.attn
    caches = [allocate_kv_cache(1, 4096, 16, attn.num_kv_heads, attn.head_dim, x.dtype, "cpu")[0] for _ in range(2)]
    slots = torch.randperm(4096 * 16, generator=g)[:num_tokens]
    deltas = tuple(torch.randn(num_tokens, spec.hidden_size, generator=g) for _ in range(2))  # the last layer's
    expected = (*layer.attention_inputs.eager(layer, x, *deltas, cos, sin, *caches[0], slots), *caches[0],
                *layer.attention_output_and_mlp.eager(layer, x, o))
    # the regions against the layer written plainly: the stream sums the last layer's two additions
    stream = x + deltas[0] + deltas[1]
    h = layer.self_attn.out(o)
    torch.testing.assert_close(expected[1], stream)
    torch.testing.assert_close(expected[4:], (h, layer.mlp(layer.post_attention_layernorm(x + h))))
    set_fused_elementwise(True)
    try:
        (q, s), code = run_and_get_code(layer.attention_inputs, x, *deltas, cos, sin, *caches[1], slots)
        got = (q, s, *caches[1], *layer.attention_output_and_mlp(x, o))
    finally:
        set_fused_elementwise(False)
    for a, b in zip(got, expected):  # fp32; Inductor reorders the reductions a little
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # The K/V write is in place: every buffer the region allocates holds per-token rows. torch 2.11's Inductor
    # copied the whole cache through a flattened view of it (a buffer shaped [num_blocks*block_size, Hkv, D]).
    shapes = re.findall(r"empty_strided_\w+\(\(([^)]*)\)", "\n".join(code))
    assert shapes and all(s.split(",")[0].strip() == shapes[0].split(",")[0].strip() for s in shapes), shapes


def first_layer_and_inputs(num_tokens: int):
    """The tiny model's first decoder layer, its attention, and inputs for its first region: x, cos, sin."""
    model = LLM(num_kv_blocks=16, enforce_eager=True).llm_engine.runner.model
    layer = model.model.layers[0]
    x = torch.randn(num_tokens, model.spec.hidden_size)
    cos, sin = model.model.rotary[model.model.rope_key[layer.layer_type]](torch.arange(num_tokens), x.dtype)
    return layer, layer.self_attn.attn, x, cos, sin


def test_a_region_compiled_on_the_sizing_steps_cache_serves_the_real_one(gpu_shaped_engines):
    """The KV-sizing step runs under inference_mode on a scratch cache; the engine's own cache is made outside
    it. Dynamo guards on a tensor's dispatch keys, so the two must be the same kind of tensor, or every layer
    region that writes the cache is compiled again for the real one."""
    from flexengine.attention.kv_cache import allocate_kv_cache
    from flexengine.compile import set_fused_elementwise
    layer, attn, x, cos, sin = first_layer_and_inputs(3)
    slots = torch.tensor([0, 1, 2])
    cache = lambda: allocate_kv_cache(1, 4, 16, attn.num_kv_heads, attn.head_dim, x.dtype, "cpu")[0]  # noqa: E731
    set_fused_elementwise(True)
    try:
        with torch.inference_mode():
            layer.attention_inputs(x, None, None, cos, sin, *cache(), slots)  # the sizing step's
        real = cache()
        before = compile_count()
        with torch.inference_mode():
            layer.attention_inputs(x, None, None, cos, sin, *real, slots)
    finally:
        set_fused_elementwise(False)
    assert compile_count() == before
    assert real[0][:3].abs().sum() > 0  # the step's keys went into the real cache


def test_the_kv_writing_region_compiles_the_page_shape_as_constants():
    """The region that stores K/V is compiled for the cache's page size, heads and head size (a dynamic page size
    made the H100's store kernel divide by it in 64 bits, per element), and for any number of pages."""
    from flexengine.attention.kv_cache import allocate_kv_cache
    from flexengine.compile import reset_fused, set_fused_elementwise
    reset_fused()
    layer, attn, x, cos, sin = first_layer_and_inputs(3)
    slots = torch.tensor([0, 9, 17])
    counts = []
    set_fused_elementwise(True)
    try:
        for pages, page_size in ((4, 32), (9, 32), (4, 8), (7, 8)):  # never the head size (16): duck sizing
            cache = allocate_kv_cache(1, pages, page_size, attn.num_kv_heads, attn.head_dim, x.dtype, "cpu")[0]
            before = compile_count()
            layer.attention_inputs(x, None, None, cos, sin, *cache, slots)
            counts.append(compile_count() - before)
            k = cache[0].flatten(0, 1)[slots]
            assert k.abs().sum(-1).all() and not cache[0].flatten(0, 1)[1:9].any()
    finally:
        set_fused_elementwise(False)
    assert counts == [1, 0, 1, 0], counts


def per_request_softcap(score, b, h, q_idx, kv_idx, cap: float):
    return cap[b] * torch.tanh(score / cap[b])


def softcap_traffic(caps):
    """Four short prompts, prefilled together in the first step; every later step is a pure decode."""
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 1 for j in range(3 + 2 * i)]} for i in range(len(caps))]
    return prompts, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, attention_params={"cap": c})
                     for c in caps]


def count_graph_passes(runner) -> list:
    """Wrap the decode-graph runner's three entry points; returns the list each pass appends to."""
    passes, graphs = [], runner.decode_graphs
    run, run_next, run_moved_on = graphs.run, graphs.run_next, graphs.run_moved_on
    graphs.run = lambda *a, **kw: passes.append("run") or run(*a, **kw)
    graphs.run_next = lambda *a: passes.append("next") or run_next(*a)
    graphs.run_moved_on = lambda *a: passes.append("moved") or run_moved_on(*a)
    return passes


@pytest.mark.parametrize("steps", [1, 4])
def test_float_parameters_run_on_the_decode_graphs_without_recompiles(gpu_shaped_engines, steps):
    """A score mod reading a per-request `cap: float`: every decode pass goes through the graph runner
    (four at a time with num_scheduler_steps=4), new values compile nothing, and the tokens are the
    dense reference backend's."""
    caps = [[0.05, 0.3, 1.5, 40.0], [0.2, 25.0, 0.08, 2.5]]  # an int64 buffer would truncate most to 0
    config = dict(score_mod=per_request_softcap, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48,
                  max_model_len=64)
    llm = LLM(**config, num_scheduler_steps=steps)
    runner = llm.llm_engine.runner
    assert runner.decode_graphs is not None
    passes = count_graph_passes(runner)
    before = compile_count()
    got = [[o.outputs[0].token_ids for o in llm.generate(*softcap_traffic(c), use_tqdm=False)] for c in caps]
    assert compile_count() == before, "a float parameter compiled a kernel after warm-up"
    assert len(passes) == 2 * 7, passes  # 7 decode passes per generate, after the prefill step
    assert passes.count("next") == (2 * 5 if steps == 4 else 0)  # passes of 4 and 3 decodes
    # one step at a time, the batch after the first decode is the last one's moved on: only its changes are sent
    assert passes.count("moved") == (2 * 6 if steps == 1 else 0)
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks
    gpu_shaped_engines()
    reference = LLM(**config, attention_backend="reference")
    expected = [[o.outputs[0].token_ids for o in reference.generate(*softcap_traffic(c), use_tqdm=False)]
                for c in caps]
    assert got == expected
    assert got[0] != got[1], "the caps changed nothing: the test would not see them ignored"


MIXED_KEYS_CONFIG = dict(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=96, max_model_len=96)


def prepared_mixed_keys(runner) -> set:
    """The mixed-graph keys capture_mixed_graphs prepares (on CPU nothing is captured at start-up; the keys are
    what counts)."""
    from flexengine.compile.warmup import capture_mixed_graphs
    runner.mixed_graphs.decode_shape.clear()
    capture_mixed_graphs(runner)
    return set(runner.mixed_graphs.decode_shape)


def mixed_keys_met(graphs) -> list:
    """The key of every step MixedGraphRunner.run serves from here on."""
    met = []
    run = graphs.run
    graphs.run = lambda *args, **kw: met.append(args[4]) or run(*args, **kw)
    return met


@pytest.mark.parametrize("whole_tiles", [16, 1])
def test_start_up_captures_every_mixed_layout_traffic_meets(gpu_shaped_engines, whole_tiles, monkeypatch):
    """With every decode bucket beside prompt tokens (policy.MIXED_DECODE_BASE None), capture_mixed_graphs prepares
    one key per (decode bucket or none, tile bucket); mixed traffic then meets no step layout with prompt tokens that
    start-up did not prepare; also where the 2-tile keys are past the whole graphs' tiles (their plan and metadata
    alone)."""
    from flexengine.compile import mixed_graphs, policy
    monkeypatch.setattr(mixed_graphs, "MAX_GRAPH_TILES", whole_tiles)
    monkeypatch.setattr(policy, "MIXED_DECODE_BASE", None)
    llm = LLM(**MIXED_KEYS_CONFIG)
    graphs = llm.llm_engine.runner.mixed_graphs
    keys = prepared_mixed_keys(llm.llm_engine.runner)
    # a step of 256 tokens is at most 2 tiles of the packed token buffer, whatever its requests
    expected = {(d, t) for d in (0, 1, 2, 4, 8, 16) for t in (1, 2)}
    assert {(k.num_decode, k.num_tiles) for k in keys} == expected
    met = mixed_keys_met(graphs)
    prompts, params = mixed_traffic(n=40, max_len=90, max_tokens=20, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)
    assert set(met) <= keys, "traffic met a layout start-up did not capture"
    assert len(set(met)) >= 4  # several decode buckets beside prompts
    assert {graphs.whole(k) for k in met} == ({True} if whole_tiles == 16 else {True, False})


def test_mixed_steps_on_fewer_decode_buckets_compile_nothing_after_warm_up(gpu_shaped_engines):
    """policy.MIXED_DECODE_BASE 4, the default: the decode rows beside prompt tokens pad to the decode buckets 1, 4
    and 16 alone (of 1-16); start-up prepares those keys alone, traffic meets no other, compiles nothing after
    warm-up (the decode rows' shapes are decode buckets' too), and the tokens are the eager engine's."""
    from flexengine.compile import policy
    assert policy.MIXED_DECODE_BASE == 4
    llm = LLM(**MIXED_KEYS_CONFIG)
    runner = llm.llm_engine.runner
    assert runner.decode_buckets == [1, 2, 4, 8, 16] and runner.mixed_decode_buckets == [1, 4, 16]
    keys = prepared_mixed_keys(runner)
    assert {(k.num_decode, k.num_tiles) for k in keys} == {(d, t) for d in (0, 1, 4, 16) for t in (1, 2)}
    met = mixed_keys_met(runner.mixed_graphs)
    traffic = [mixed_traffic(n=n, seed=n, max_len=90, max_tokens=20, temperature=0) for n in (6, 40)]  # (few, many)
    before = compile_count()
    got = [llm.generate(prompts, params, use_tqdm=False) for prompts, params in traffic]
    assert compile_count() == before, "a shape compiled after warm-up"
    assert set(met) <= keys and {k.num_decode for k in met} >= {4, 16}, set(met)
    gpu_shaped_engines()
    eager = LLM(**MIXED_KEYS_CONFIG, enforce_eager=True)
    for (prompts, params), outputs in zip(traffic, got):
        expected = eager.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def test_plan_graphs_left_to_first_use_compile_nothing_after_warm_up(gpu_shaped_engines, monkeypatch):
    """warmup.CAPTURE_PLAN_GRAPHS off (a start-up knob): start-up prepares the whole graphs' keys alone, traffic
    meets the 2-tile keys past them (their plan and metadata alone) at run time, which compiles nothing after
    warm-up, and the tokens are the eager engine's."""
    from flexengine.compile import mixed_graphs, warmup
    monkeypatch.setattr(mixed_graphs, "MAX_GRAPH_TILES", 1)
    monkeypatch.setattr(warmup, "CAPTURE_PLAN_GRAPHS", False)
    llm = LLM(**MIXED_KEYS_CONFIG)
    graphs = llm.llm_engine.runner.mixed_graphs
    assert {k.num_tiles for k in prepared_mixed_keys(llm.llm_engine.runner)} == {1}
    met = mixed_keys_met(graphs)
    prompts, params = mixed_traffic(n=40, max_len=90, max_tokens=20, temperature=0)
    before = compile_count()
    got = llm.generate(prompts, params, use_tqdm=False)
    assert compile_count() == before, "a shape compiled after warm-up"
    assert any(not graphs.whole(k) for k in met), "traffic met no plan-only key: the test would see nothing"
    gpu_shaped_engines()
    expected = LLM(**MIXED_KEYS_CONFIG, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_compiled_take_inputs_and_rotary_tables_equal_eager(monkeypatch, tmp_path):
    """What the CUDA engine runs through Inductor inside the decode graphs (here Inductor on the CPU): the step's
    inputs taken from the one staged buffer (a still step changes nothing, a moving one moves rows on by one token
    with their new pages, a filling one replaces every row; one dynamic graph for one row, one for several) and
    rotary's cos/sin (one kernel a step) give what the eager code gives, and what the modes mean."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cached graph brings its old guards
    from flexengine.compile import compile_count, compiled_on_first_use, configure_dynamo, reset_fused, \
        set_fused_elementwise
    from flexengine.compile.cuda_graphs import DecodeBuffers, take_inputs
    from flexengine.layers.rotary import default_inv_freq, fused_cos_sin
    torch._dynamo.reset()
    configure_dynamo()
    compiled = compiled_on_first_use(take_inputs)()  # as the engine compiles it (no duck sizing)
    g = torch.Generator().manual_seed(0)
    max_bs, width, scratch, P = 12, 6, 999, 16
    before = compile_count()
    # the largest bucket first (bs == max_bs), as capture_all compiles them
    for n, k, mode in ((11, 0, 2), (1, 1, 1), (2, 0, 1), (5, 3, 1), (9, 2, 1), (5, 2, 0), (3, 0, 2), (1, 0, 2),
                       (9, 0, 2), (4, 2, 3), (1, 0, 3), (7, 3, 3)):
        bs = n + 1
        bufs = DecodeBuffers(max_bs, width, {}, scratch, "cpu")
        bufs.input_ids.copy_(torch.randint(0, 90, (max_bs,), generator=g))
        bufs.positions.copy_(torch.randint(0, 60, (max_bs,), generator=g))
        bufs.seq_lens.copy_(torch.randint(1, 90, (max_bs,), generator=g, dtype=torch.int32))
        bufs.block_tables.copy_(torch.randint(0, 50, (max_bs, width), generator=g, dtype=torch.int32))
        bufs.inputs.copy_(torch.randint(1, 6, bufs.inputs.shape, generator=g))  # stale entries everywhere
        if mode == 2:
            seqs = [fake_seq(i, int(torch.randint(1, width * P, (1,), generator=g)),
                             torch.randint(0, 50, (width,), generator=g).tolist()) for i in range(n)]
            for s_ in seqs:
                s_.block_table = s_.block_table[: -(-s_.num_tokens // P)]
            packed = pack_decode(seqs, P, columns=max_bs)
            bufs.stage(packed, n, {})
        else:
            bufs.inputs[:3] = torch.tensor([mode, n, k])
            rows = torch.randperm(n, generator=g)[:k]
            bufs.inputs[3:3 + 3 * k] = torch.stack([rows, torch.randint(1, 6, (k,), generator=g),
                                                    torch.randint(100, 200, (k,), generator=g)], 1).flatten()
            src = torch.randperm(max_bs, generator=g)[:n]  # GATHER: row i was row src[i] (any of the last batch's)
            bufs.inputs[3 + 3 * max_bs:3 + 3 * max_bs + n] = src
        bufs.fed_ids.copy_(torch.randint(0, 1000, (max_bs,), generator=g))
        state = [bufs.input_ids[:bs], bufs.positions[:bs], bufs.seq_lens, bufs.block_tables, bufs.slot_mapping[:bs]]
        before_state = [t.clone() for t in state]
        want, got = [t.clone() for t in state], [t.clone() for t in state]
        take_inputs(bufs.inputs, bufs.fed_ids, *want, P, scratch)
        compiled(bufs.inputs, bufs.fed_ids, *got, P, scratch)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (n, mode)
        ids, pos, lens, tables, slots = want
        if mode == 0:
            assert all(torch.equal(a, b) for a, b in zip(want, before_state))
        elif mode == 1:
            expect_tables = before_state[3].clone()
            for r, c, p in bufs.inputs[3:3 + 3 * k].view(k, 3).tolist():
                expect_tables[r, c] = p
            assert torch.equal(tables, expect_tables)
            assert torch.equal(ids[:n], bufs.fed_ids[:n]) and torch.equal(ids[n:], before_state[0][n:])
            assert torch.equal(pos[:n], before_state[1][:n] + 1) and torch.equal(pos[n:], before_state[1][n:])
            assert torch.equal(lens[:n], before_state[2][:n] + 1) and torch.equal(lens[n:], before_state[2][n:])
            page = expect_tables[torch.arange(n), pos[:n] // P]
            assert torch.equal(slots[:n], page.long() * P + pos[:n] % P)
        elif mode == 3:  # the rows taken from their sources, then moved on as mode 1; rows past n inert
            expect_tables = before_state[3].clone()
            expect_tables[:n] = before_state[3][src]
            for r, c, p in bufs.inputs[3:3 + 3 * k].view(k, 3).tolist():
                expect_tables[r, c] = p
            assert torch.equal(tables, expect_tables)
            assert torch.equal(ids[:n], bufs.fed_ids[src]) and torch.equal(ids[n:], before_state[0][n:])
            assert torch.equal(pos[:n], before_state[2][src].long()) and torch.equal(pos[n:], before_state[1][n:])
            assert torch.equal(lens[:n], before_state[2][src] + 1) and not lens[n:].any()
            page = expect_tables[torch.arange(n), pos[:n] // P]
            assert torch.equal(slots[:n], page.long() * P + pos[:n] % P) and (slots[n:] == scratch).all()
        else:  # the ordinary pack, row by row; every row past n inert (length 0, the scratch slot)
            assert torch.equal(ids[:n], torch.tensor([s_.token_ids[-1] for s_ in seqs]))
            assert torch.equal(pos[:n], torch.tensor([s_.num_tokens - 1 for s_ in seqs]))
            assert lens[:n].tolist() == [s_.num_tokens for s_ in seqs] and not lens[n:].any()
            for i, s_ in enumerate(seqs):
                assert tables[i, : len(s_.block_table)].tolist() == s_.block_table
                q = s_.num_tokens - 1
                assert slots[i] == s_.block_table[q // P] * P + q % P
            assert (slots[n:] == scratch).all()
    assert compile_count() - before == 1, "one dynamic graph for every bucket past one row"
    reset_fused()
    positions, inv_freq = torch.arange(0, 3000, 37), default_inv_freq(64, 500000.0)
    expected = fused_cos_sin.eager(positions, inv_freq, torch.bfloat16)
    set_fused_elementwise(True)
    try:
        got = fused_cos_sin(positions, inv_freq, torch.bfloat16)
    finally:
        set_fused_elementwise(False)
    for a, b in zip(got, expected):
        assert a.shape == b.shape == (len(positions), 1, 32) and a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, atol=2 ** -7, rtol=0)  # Inductor's sin/cos: a bf16 ulp apart at most


def test_combo_kernels_env_refuses_nonsense(monkeypatch):
    from flexengine.config import env_combo_kernels
    monkeypatch.setenv("FLEXENGINE_COMBO_KERNELS", "yes")
    with pytest.raises(ValueError, match="FLEXENGINE_COMBO_KERNELS must be 0 or 1"):
        env_combo_kernels()


@pytest.mark.parametrize("mode", ["", "off", "on"])
def test_pdl_env_asks_inductor_for_programmatic_launches(monkeypatch, mode):
    """FLEXENGINE_PDL on (or unset: the default) puts Inductor's triton.enable_pdl into every region's compile and
    flex's, but for the helpers of steps with prompt tokens only (the mixed graphs' plan, the symbolic prefill
    call: their kernels would each need a launcher built by gcc at start-up); off leaves it out everywhere; anything
    else is refused, naming the variable."""
    from flexengine.attention.backends import flex_kernels
    from flexengine.compile import mixed_graphs
    from flexengine.compile.policy import compile_region, compiled_on_first_use
    monkeypatch.setenv("FLEXENGINE_PDL", mode)
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw.get("options", {})) or fn)
    caches = (flex_kernels.compiled_flex, flex_kernels.compiled_symbolic, mixed_graphs._compiled_plan)
    for cache in caches:
        cache.cache_clear()
    try:
        compile_region(lambda x: x, combo=False)
        flex_kernels.compiled_flex()
        compiled_on_first_use(lambda x: x)()
        flex_kernels.compiled_symbolic(flex_kernels.flex_for_decode)
        mixed_graphs._compiled_plan()
        flex_kernels.compiled_symbolic(flex_kernels.flex_for_prefill)
    finally:
        for cache in caches:
            cache.cache_clear()
    assert [o.get("triton.enable_pdl", False) for o in seen] == [mode != "off"] * 4 + [False] * 2
    monkeypatch.setenv("FLEXENGINE_PDL", "yes")
    with pytest.raises(ValueError, match="FLEXENGINE_PDL must be one of on, off"):
        compile_region(lambda x: x, combo=False)


def test_decode_graph_metadata_gives_the_page_lists_no_new_compile_beside_mixed_steps(monkeypatch, tmp_path):
    """The decode graphs' metadata hands the compiled page lists each layout array as a tensor of its own (storage
    offset 0), as the mixed graphs' plan does. Views of one packed copy sat at offsets that differ by bucket and
    from the mixed steps' 0; on the H100 dynamo guarded on offsets 0 and 1 there, and the lists compiled again for
    each kind (2 of decode_lists' 6 graphs at start-up, session 32). The CPU's compile made no such guard here, so
    the offsets are checked, and then that two decode buckets' metadata and a mixed-style one (arrays of their own,
    more rows), on one code path (one split a row), compile one graph."""
    import numpy as np

    from flexengine import masks
    from flexengine.attention.backends.paged_mods import decode_lists
    from flexengine.attention.layout import plan_layout
    from flexengine.attention.metadata import LAYOUT_FIELDS, metadata_on_device
    from flexengine.compile import compiled_on_first_use
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cached graph brings its old guards
    monkeypatch.setenv("FLEXENGINE_DECODE_SPLITS", "1")
    llm = LLM(block_size=8, num_kv_blocks=32, enforce_eager=True)
    r = llm.llm_engine.runner
    g = cpu_decode_graphs(r, 8)
    torch._dynamo.reset()
    lists = compiled_on_first_use(decode_lists)()
    b, NB = g.bufs, r.num_blocks + 1
    with torch.inference_mode():
        metas = [g.static_meta(8), g.static_meta(4)]
        assert {g.splits[8], g.splits[4]} == {1}
        offsets = {(bs, f): getattr(m, f).storage_offset() for bs, m in zip((8, 4), metas) for f in LAYOUT_FIELDS}
        assert set(offsets.values()) == {0}, {k: v for k, v in offsets.items() if v}
        layout = plan_layout([1] * 6, [1] * 6, decode_splits=1)
        own = {f: torch.as_tensor(np.asarray(getattr(layout, f), dtype=np.int64)) for f in LAYOUT_FIELDS}
        metas.append(metadata_on_device(layout, own, b.block_tables, b.seq_lens, b.slot_mapping[:6], 8, NB))
        before = compile_count()
        kept = [torch.zeros(9, NB, dtype=torch.int32) for _ in range(2)]  # (a row more: decode_lists lists one)
        for meta in metas:
            lists(meta, masks.causal, [], *kept)
    assert compile_count() - before == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compile_workers_are_up_before_the_first_compile():
    """start_compile_workers (the runner calls it before loading weights) brings Inductor's Triton workers up, so a
    later first compile goes to them: in a fresh process, where nothing has started them, the readiness job is
    submitted by the call and the pool answers ready soon after (a torch whose AsyncCompile changed fails here)."""
    import subprocess
    import sys
    code = ("import time, torch\n"
            "from torch._inductor.async_compile import AsyncCompile\n"
            "from flexengine.compile import start_compile_workers\n"
            "assert AsyncCompile._ready_future is None\n"
            "start_compile_workers()\n"
            "assert AsyncCompile._ready_future is not None\n"
            "deadline = time.time() + 120\n"
            "while not AsyncCompile.use_process_pool():\n"
            "    assert time.time() < deadline, 'the compile workers did not come up in 120 s'\n"
            "    time.sleep(0.1)\n"
            "print('ready')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ready"), out.stderr[-2000:]
