"""The flash backend: selection, its errors, and the arguments it hands each FlashAttention provider.

Providers are faked at the import boundary only (sys.modules / importlib.util.find_spec): each fake has
the real entry point's parameter names (no **kwargs, so a misspelt argument fails) and computes paged
attention with plain torch, so the backend's output can be compared with the reference backend on CPU.
"""
import importlib.machinery
import importlib.util
import logging
import os
import random
import sys
import types

import pytest
import torch

from attention_reference import make_paged_batch
from flexengine import masks
from flexengine.attention import paged_attention
from flexengine import LLM, SamplingParams
from flexengine.attention.backends import flash, get_backend
from flexengine.attention.backends.flex import FlexBackend
from flexengine.attention.backends.reference import ReferenceBackend
from flexengine.attention.metadata import build_metadata
from flexengine.attention.layout import plan_layout

CALLS = []  # (provider label, kwargs of interest) per fake kernel call


def attend_pages(q, k, v, cu_q, k_lens, page_table, scale, causal, window, softcap):
    """Plain paged attention with FlashAttention's conventions (bottom-right causal, window (left, right))."""
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert cu_q.dtype == torch.int32 and cu_q.shape == (len(k_lens) + 1,)
    P, Hkv, D = k.shape[1:]
    Hq = q.shape[1]
    left, right = (None if w is None or w < 0 else w for w in window)
    out = torch.zeros_like(q)
    cu = cu_q.tolist()
    for b, L in enumerate(k_lens):
        n = cu[b + 1] - cu[b]
        pages = page_table[b, : (L + P - 1) // P].long()
        kb = k[pages].reshape(-1, Hkv, D)[:L].float().repeat_interleave(Hq // Hkv, dim=1)
        vb = v[pages].reshape(-1, Hkv, D)[:L].float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].float(), kb) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos, kpos = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
        ok = torch.ones(n, L, dtype=torch.bool)
        if causal:
            ok &= kpos <= qpos
        if left is not None:
            ok &= kpos >= qpos - left
        if right is not None:
            ok &= kpos <= qpos + right
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", p, vb).to(q.dtype)
    return out


def fa4_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
               softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
               num_splits=1, pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
               block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False):
    assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"  # FA4's own rule
    assert seqused_k.dtype == torch.int32
    k_lens = seqused_k.tolist()
    assert max(k_lens) <= max_seqlen_k and max(cu_seqlens_q.diff().tolist()) <= max_seqlen_q
    CALLS.append(("FA4", dict(window_size=window_size, softcap=softcap, scale=softmax_scale)))
    out = attend_pages(q, k, v, cu_seqlens_q, k_lens, page_table, softmax_scale, causal, window_size, softcap)
    return out, None


def fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
               return_attn_probs=False, block_table=None):
    assert k.shape[1] % 256 == 0, "paged KV needs page_block_size % 256 == 0"  # FA2's own rule
    CALLS.append(("FA2", dict(window_size=window_size, softcap=softcap, scale=softmax_scale)))
    k_lens = cu_seqlens_k.diff().tolist()
    return attend_pages(q, k, v, cu_seqlens_q, k_lens, block_table, softmax_scale, causal, window_size, softcap)


def fa3_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                     cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                     cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None,
                     v_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0,
                     softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None,
                     sm_margin=0, return_softmax_lse=False):
    assert k is None and v is None  # the engine already wrote the cache
    CALLS.append(("FA3", dict(window_size=window_size, softcap=softcap, scale=softmax_scale)))
    return attend_pages(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens.tolist(), page_table, softmax_scale,
                        causal, window_size, softcap)


def fake_module(monkeypatch, name, origin=None, is_package=False, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=origin, is_package=is_package)
    if is_package:
        mod.__path__ = []
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


@pytest.fixture
def providers(monkeypatch):
    """install(*labels): present exactly those fake providers; the rest are absent (sys.modules[name] = None)."""
    CALLS.clear()
    monkeypatch.setattr(flash, "_NOTICED", set())

    def install(*labels):
        for name in ("flash_attn_interface", "flash_attn", "flash_attn.cute"):
            monkeypatch.setitem(sys.modules, name, None)  # find_spec() → None, import → ImportError
        if "FA3" in labels:
            fake_module(monkeypatch, "flash_attn_interface", origin="/fake/flash_attn_interface.py",
                        flash_attn_with_kvcache=fa3_with_kvcache)
        if "FA2" in labels:  # a regular package: flash_attn/__init__.py
            fake_module(monkeypatch, "flash_attn", origin="/fake/flash_attn/__init__.py", is_package=True,
                        flash_attn_varlen_func=fa2_varlen)
        elif "FA4" in labels:  # flash-attn-4 alone: flash_attn is a namespace package
            fake_module(monkeypatch, "flash_attn", is_package=True)
        if "FA4" in labels:
            cute = fake_module(monkeypatch, "flash_attn.cute", flash_attn_varlen_func=fa4_varlen)
            sys.modules["flash_attn"].cute = cute
    return install


CAUSAL = [(masks.causal, None)]


# ---------------------------------------------------------------- selection
def test_explicit_flash_without_provider_says_so(providers):
    providers()
    assert flash.find_flash_provider() is None
    with pytest.raises(ValueError, match="no FlashAttention provider is installed"):
        get_backend("flash", CAUSAL, head_dim=64)


def test_auto_without_provider_is_flex_and_quiet(providers, caplog):
    providers()
    with caplog.at_level(logging.WARNING):
        assert get_backend("auto", CAUSAL, head_dim=64).name == "flex"
    assert not caplog.records


@pytest.mark.parametrize("mods,named", [
    ([(masks.chunked_local(8), None)], r"chunked_local\(8\)"),
    ([(masks.causal, None), (masks.prefix_lm(4), None)], r"prefix_lm\(4\)"),
    ([(masks.causal, masks.alibi([0.5, 0.25]))], r"alibi\(2 heads\)"),
])
def test_explicit_flash_names_the_mod_it_cannot_express(providers, mods, named):
    providers("FA4")
    with pytest.raises(ValueError, match=named):
        get_backend("flash", mods, head_dim=64)
    assert get_backend("auto", mods, head_dim=64).name == "flex"


def test_auto_head_size_72_is_flex_with_one_notice(providers, caplog):
    providers("FA4")
    with caplog.at_level(logging.WARNING):
        assert get_backend("auto", CAUSAL, head_dim=72).name == "flex"
        assert get_backend("auto", CAUSAL, head_dim=72).name == "flex"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "head size 72" in lines[0] and "\n" not in lines[0]
    with pytest.raises(ValueError, match="head size 72"):
        get_backend("flash", CAUSAL, head_dim=72)


def test_auto_picks_flash_when_every_layer_fits(providers):
    providers("FA4")
    mods = [(masks.causal, None), (masks.sliding_window(64), masks.softcap(50.0))]
    backend = get_backend("auto", mods, head_dim=128)
    assert backend.name == "flash" and backend.provider.label == "FA4"


def test_env_override_selects_flash(providers, monkeypatch):
    monkeypatch.setenv("FLEXENGINE_ATTENTION_BACKEND", "flash")
    providers("FA4")
    assert get_backend(None, CAUSAL, head_dim=64).name == "flash"
    providers()
    with pytest.raises(ValueError, match="FLEXENGINE_ATTENTION_BACKEND.*no FlashAttention provider"):
        get_backend(None, CAUSAL, head_dim=64)


def test_fa2_page_size_rule_and_provider_order(providers, caplog):
    providers("FA2")
    with pytest.raises(ValueError, match=r"block_size % 256 == 0"):
        get_backend("flash", CAUSAL, head_dim=64, block_size=16)
    with caplog.at_level(logging.WARNING):
        assert get_backend("auto", CAUSAL, head_dim=64, block_size=16).name == "flex"
    assert "block_size 16" in caplog.records[0].getMessage()
    assert get_backend("flash", CAUSAL, head_dim=64, block_size=256).provider.label == "FA2"
    providers("FA2", "FA4")  # FA2 first where the page size allows it, FA4 for any other page size
    assert get_backend("flash", CAUSAL, head_dim=64, block_size=256).provider.label == "FA2"
    assert get_backend("flash", CAUSAL, head_dim=64, block_size=16).provider.label == "FA4"
    providers("FA3", "FA2", "FA4")
    assert flash.find_flash_provider(16) == "flash_attn_interface"


@pytest.mark.parametrize("user_value", [None, "0"])
def test_fa4_keeps_its_compiled_kernels_on_disk_unless_the_user_said_no(providers, monkeypatch, user_value):
    """FA4 reads FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED when flash_attn.cute is imported: the engine turns it on
    before importing it (a second start on one machine then loads FA4's kernels), and leaves a user's value."""
    from flexengine.attention.backends import prefill_kernel
    if user_value is None:
        monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", user_value)
    providers("FA4")
    seen = []
    with monkeypatch.context() as m:  # (importlib is the interpreter's own: undone before torch imports more)
        m.setattr(flash.importlib, "import_module",
                  lambda name: seen.append(os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")) or sys.modules[name])
        flash.load_kernel(flash.PROVIDERS[-1])  # the flash backend's import of flash_attn.cute
    assert seen == [user_value or "1"]
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    prefill_kernel.fa4_installed.cache_clear()  # flex's prefill kernel asks before torch imports it
    prefill_kernel.fa4_installed()
    prefill_kernel.fa4_installed.cache_clear()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"


def test_compile_caches_default_to_flexengines_cache_folder_unless_set(monkeypatch, tmp_path):
    """A GPU engine keeps Inductor's and FA4's compiled kernels under cache_dir() (their own defaults are in the
    temp folder, emptied by a reboot), and leaves folders the user named."""
    from flexengine.config import compile_cache_defaults
    monkeypatch.setenv("FLEXENGINE_CACHE_DIR", str(tmp_path))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    compile_cache_defaults()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "fa4")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/mine/fa4")
    compile_cache_defaults()
    assert (os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"]) == ("/mine", "/mine/fa4")


def test_inductor_compiles_into_flexengines_cache_folder_after_the_imports_a_user_makes(tmp_path):
    """Importing torch._dynamo (as `from flexengine import LLM` does) sets TORCHINDUCTOR_CACHE_DIR to Inductor's temp
    folder; the engine's defaults still move Inductor's cache, as Inductor itself reads it, under cache_dir()."""
    import subprocess
    import sys
    code = ("import os; from flexengine import LLM; assert os.environ['TORCHINDUCTOR_CACHE_DIR']; "
            "from flexengine.config import compile_cache_defaults; compile_cache_defaults(); "
            "from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir; "
            "print(cache_dir(), triton_cache_dir(0))")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "FLEXENGINE_CACHE_DIR": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "inductor"), str(tmp_path / "inductor" / "triton" / "0")]


def test_dtype_other_than_half_is_refused(providers):
    providers("FA4")
    with pytest.raises(ValueError, match="float32"):
        get_backend("flash", CAUSAL, head_dim=64, dtype=torch.float32)
    assert get_backend("auto", CAUSAL, head_dim=64, dtype=torch.float32).name == "flex"


def test_provider_import_failure_is_reported(providers, monkeypatch, caplog):
    providers()
    fake_module(monkeypatch, "flash_attn", is_package=True)
    monkeypatch.delitem(sys.modules, "flash_attn.cute")  # found on the path below, but not importable
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        importlib.machinery.ModuleSpec(name, None) if name == "flash_attn.cute" else real_find_spec(name, *a)))
    with pytest.raises(ValueError, match=r"flash_attn.cute \(FA4\) is installed but failed to import"):
        get_backend("flash", CAUSAL, head_dim=64)
    with caplog.at_level(logging.WARNING):
        assert get_backend("auto", CAUSAL, head_dim=64).name == "flex"
    assert "failed to import" in caplog.records[0].getMessage()


# ---------------------------------------------------------------- numerics through the fakes
def make_step(seq_lens, query_lens, block_size, Hq=4, Hkv=2, D=64, seed=0, engine_slots=False, dtype=torch.bfloat16):
    q, kc, vc, tables = make_paged_batch(random.Random(seed), seq_lens, query_lens, block_size, Hq, Hkv, D,
                                         dtype=dtype, garbage=False)  # the engine pads block tables with page 0
    tables_t = torch.tensor(tables, dtype=torch.int32)
    slots = torch.empty(0, dtype=torch.long)
    if engine_slots:  # what the engine's prepare_step computes for a whole-prompt step
        slots = torch.cat([tables_t[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                           for i, n in enumerate(query_lens)])
    meta = build_metadata(tables_t, torch.tensor(seq_lens, dtype=torch.int32), slots,
                          plan_layout(query_lens, seq_lens, block_size=block_size), block_size, kc.shape[0])
    return q, kc, vc, meta


def run(backend, step, mask_mod, score_mod, scale=0.1):  # not 64 ** -0.5: a dropped scale shows
    q, kc, vc, meta = step
    meta.backend_state.clear()
    backend.prepare(meta, [(mask_mod, score_mod)])
    return backend.forward(q, kc, vc, meta, mask_mod, score_mod, scale)


LAYERS = [(masks.causal, None), (masks.sliding_window(5), None), (masks.sliding_window(20), masks.softcap(2.0)),
          (masks.causal, masks.softcap(30.0))]


@pytest.mark.parametrize("label,block_size", [("FA4", 16), ("FA4", 8), ("FA3", 16), ("FA2", 256)])
@pytest.mark.parametrize("mask_mod,score_mod", LAYERS)
def test_mixed_step_matches_reference(providers, label, block_size, mask_mod, score_mod):
    """Decode rows, a chunk over a cached prefix and a whole prompt in one step, GQA, bf16."""
    providers(label)
    backend = get_backend("flash", [(mask_mod, score_mod)], head_dim=64, block_size=block_size)
    step = make_step([37, 1, 300, 26, 9], [1, 1, 45, 26, 1], block_size)
    out = run(backend, step, mask_mod, score_mod)
    ref = run(ReferenceBackend(), step, mask_mod, score_mod)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    window = getattr(mask_mod, "flash_window", None)
    expected = dict(window_size=(-1, -1) if window is None else (window - 1, 0),
                    softcap=getattr(score_mod, "flash_softcap", 0.0), scale=0.1)
    assert CALLS == [(label, expected)]


@pytest.mark.parametrize("engine_slots", [False, True])
@pytest.mark.parametrize("mask_mod,score_mod", LAYERS)
def test_whole_prompt_step(providers, engine_slots, mask_mod, score_mod):
    """Every request a whole prompt: torch's kernel serves causal layers (K/V read back by slot), the
    paged kernel the rest (a window has no SDPA flash path on CPU; softcap none in torch)."""
    providers("FA4")
    backend = get_backend("flash", [(mask_mod, score_mod)], head_dim=64)
    step = make_step([40, 7, 17], [40, 7, 17], 16, engine_slots=engine_slots)
    out = run(backend, step, mask_mod, score_mod)
    ref = run(ReferenceBackend(), step, mask_mod, score_mod)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch_served = mask_mod is masks.causal and score_mod is None
    assert (CALLS == []) == torch_served


def test_functional_api_with_flash(providers):
    providers("FA4")
    step = make_step([33, 64, 5], [1, 20, 5], 16)
    q, kc, vc, meta = step
    window = masks.sliding_window(12)
    out = paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, torch.tensor([1, 20, 5]),
                          mask_mod=window, backend="flash")
    ref = run(ReferenceBackend(), step, window, None, scale=64 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_forward_refuses_float32(providers):
    providers("FA4")
    backend = get_backend("flash", CAUSAL, head_dim=64)
    with pytest.raises(ValueError, match="float16 or bfloat16, got torch.float32"):
        run(backend, make_step([9], [1], 16, dtype=torch.float32), masks.causal, None)


# ---------------------------------------------------------------- in the engine
def test_auto_with_cuda_graphs_keeps_flex_and_says_why_once(providers, caplog):
    providers("FA4")
    assert get_backend(None, CAUSAL, head_dim=64).name == "flash"  # no graphs: flash serves
    with caplog.at_level(logging.WARNING):
        assert get_backend(None, CAUSAL, head_dim=64, graphs=True).name == "flex"
        assert get_backend(None, CAUSAL, head_dim=64, graphs=True).name == "flex"
    notes = [r.getMessage() for r in caplog.records if "auto" in r.getMessage()]
    assert len(notes) == 1 and "CUDA graphs" in notes[0], notes
    assert get_backend("flash", CAUSAL, head_dim=64, graphs=True).name == "flash"  # an explicit choice wins


def tiny_llama_head_32(path) -> str:
    """A random 2-layer Llama with head size 32, one FlashAttention takes (the embedded model's is 16)."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM._from_config(config).save_pretrained(path)
    return str(path)


def test_engines_on_the_cuda_path_pick_flex_graphs_or_explicit_flash(providers, gpu_shaped_engines, tmp_path):
    """On the CUDA engine's path (taken on CPU by gpu_shaped_engines) with a fake FA4 that computes paged
    attention plainly: auto keeps flex and its decode graphs; an explicit flash engine has no graphs,
    warms up its unpadded shapes, and its tokens are the dense reference backend's."""
    providers("FA4")
    config = dict(model=tiny_llama_head_32(tmp_path), dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=24,
                  num_kv_blocks=48, max_model_len=64)
    auto = LLM(**config).llm_engine.runner
    assert auto.backend.name == "flex" and auto.decode_graphs is not None
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 250 + 1 for j in range(n)]} for i, n in enumerate([9, 30, 3])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(**config, attention_backend="flash")
    runner = llm.llm_engine.runner
    assert runner.backend.name == "flash" and runner.decode_graphs is None
    CALLS.clear()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert any(label == "FA4" for label, _ in CALLS), "no step used the paged flash kernel"
    reference = LLM(**config, attention_backend="reference")
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]


# ---------------------------------------------------------------- the real kernels
def real_provider():
    return flash.find_flash_provider() if torch.cuda.is_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(real_provider() is None, reason="needs CUDA and a FlashAttention provider")
@pytest.mark.parametrize("mask_mod,score_mod", [(masks.causal, None), (masks.sliding_window(100), masks.softcap(30.0))])
def test_flex_flash_reference_agree_on_gpu(mask_mod, score_mod):
    """A mixed decode/prefill step, then a whole-prompt step, bf16, through the installed kernels."""
    mods = [(mask_mod, score_mod)]
    block_size = 256 if real_provider() == "flash_attn" else 16
    flash_paged = get_backend("flash", mods, head_dim=128, block_size=block_size, dtype=torch.bfloat16)
    flash_paged.torch_prefill = False
    backends = [get_backend("flash", mods, head_dim=128, block_size=block_size, dtype=torch.bfloat16),
                flash_paged, FlexBackend()]
    for seq_lens, query_lens in [([700, 1, 300, 129, 1000], [1, 1, 45, 129, 1]), ([700, 300, 129], [700, 300, 129])]:
        q, kc, vc, meta = make_step(seq_lens, query_lens, block_size, Hq=8, Hkv=2, D=128)
        step = (q.cuda(), kc.cuda(), vc.cuda(),
                build_metadata(meta.block_tables.cuda(), meta.seq_lens.cuda(), meta.slot_mapping.cuda(),
                               meta.layout, block_size, kc.shape[0]))
        ref = run(ReferenceBackend(), step, mask_mod, score_mod).float()
        for backend in backends:
            out = run(backend, step, mask_mod, score_mod).float()
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=lambda m: f"{backend.name}: {m}")


def test_each_engine_owns_its_flex_workspace(gpu_shaped_engines, tmp_path):
    """Two engines in one process (different dtypes): each keeps its own prefill workspace, so the first
    still serves, with its own tokens, after the second is built (a shared backend handed the first
    engine the second's float32 workspace)."""
    config = dict(model=tiny_llama_head_32(tmp_path), max_num_seqs=4, max_num_batched_tokens=24,
                  num_kv_blocks=48, max_model_len=64)
    prompts = [{"prompt_token_ids": [(11 * i + 5 * j) % 250 + 1 for j in range(n)]} for i, n in enumerate([20, 7])]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = LLM(**config, dtype="bfloat16")
    before = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    second = LLM(**config, dtype="float32")
    assert first.llm_engine.runner.backend is not second.llm_engine.runner.backend
    second.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)] == before
