"""load_model: what loads, and the clear errors for what does not."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.models.loader import checkpoint_layout, load_model
from flexengine.models.registry import supported_architectures
from flexengine.tokenizer import IncrementalDetokenizer, build_byte_tokenizer, load_tokenizer, save_byte_tokenizer

CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, architectures=["LlamaForCausalLM"])


def save_llama(path, dtype=torch.float32, **save_kwargs) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)
    hf.save_pretrained(str(path), **save_kwargs)
    return hf


@pytest.fixture
def ckpt(tmp_path):
    save_llama(tmp_path)
    return tmp_path


def rewrite_weights(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_loads_every_tensor_into_fused_params(tmp_path):
    hf = save_llama(tmp_path)
    model, config, tokenizer = load_model(str(tmp_path))
    assert tokenizer is None and config.architectures == ["LlamaForCausalLM"]
    assert next(model.parameters()).dtype == torch.float32  # auto: the checkpoint's dtype
    sd = hf.state_dict()
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([32, 16, 16])
    assert torch.equal(q, sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(v, sd["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, sd["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    assert set(checkpoint_layout(model)) == set(sd)


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                             (torch.float32, torch.float32), ("auto", torch.bfloat16)])
def test_dtypes(tmp_path, dtype, expected):
    save_llama(tmp_path, dtype=torch.bfloat16)
    model, _, _ = load_model(str(tmp_path), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.model.rotary[next(iter(model.model.rotary))].inv_freq.dtype == torch.float32


@pytest.mark.parametrize("bad", ["int8", "fp8", "bf16x", torch.int32])
def test_bad_dtype(ckpt, bad):
    with pytest.raises(ValueError, match="unsupported dtype.*accepted: auto, float32, bfloat16, float16"):
        load_model(str(ckpt), dtype=bad)


def test_sharded_checkpoint(tmp_path):
    hf = save_llama(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    model, _, _ = load_model(str(tmp_path))
    norm = model.model.layers[1].post_attention_layernorm.weight
    assert torch.equal(norm, hf.state_dict()["model.layers.1.post_attention_layernorm.weight"])
    shard = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=f"lists shard '{shard}', which is missing"):
        load_model(str(tmp_path))


def test_truncated_file(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="model.safetensors: truncated or corrupt"):
        load_model(str(ckpt))


def test_missing_tensor(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model.layers.1.self_attn.k_proj.weight"):
        load_model(str(ckpt))


def test_unexpected_tensor(ckpt):
    rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) in checkpoint: model.layers.0.self_attn.extra"):
        load_model(str(ckpt))


def test_harmless_extra_is_ignored(ckpt):
    rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}))
    load_model(str(ckpt))


def test_misshaped_tensor(ckpt):
    rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(47, 32)}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \[47, 32\].*expected \[48, 32\]"):
        load_model(str(ckpt))


def test_unknown_architecture(ckpt):
    config = json.load(open(ckpt / "config.json"))
    config["architectures"] = ["FalconForCausalLM"]
    json.dump(config, open(ckpt / "config.json", "w"))
    with pytest.raises(ValueError, match="unsupported model architecture: FalconForCausalLM; supported: .*LlamaForCausalLM"):
        load_model(str(ckpt))
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(supported_architectures())


def test_uncached_hub_id(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="'flexengine-tests/no-such-model' is not a local directory and is not cached"):
        load_model("flexengine-tests/no-such-model")
    with pytest.raises(ValueError, match="is not a directory"):
        load_model(str(tmp_path / "no" / "such" / "dir"))


def test_no_safetensors(tmp_path):
    save_llama(tmp_path)
    os.rename(tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no safetensors weights.*pytorch_model.bin"):
        load_model(str(tmp_path))


def test_tokenizer_loaded_when_present(ckpt):
    save_byte_tokenizer(str(ckpt))
    _, _, tokenizer = load_model(str(ckpt))
    assert tokenizer.decode(tokenizer.encode("héllo", add_special_tokens=False)) == "héllo"
    assert load_tokenizer(str(ckpt / "nothing-here")) is None


def test_incremental_detokenizer_holds_back_split_characters():
    tok = build_byte_tokenizer()
    text = "a é🙂 z"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=[tok.bos_token_id])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[ids.index(0xF0):ids.index(0xF0) + 4] == ["", "", "", "🙂"]
    detok.add(0xE2)  # a broken tail comes out only at the end, as U+FFFD
    assert detok.flush() == "\ufffd"


class ChunkTokenizer:
    """Tokens are byte strings that may split a UTF-8 character, decoded as byte-level BPE does."""
    CHUNKS = [b"a", b" ", b"\xc3", b"\xa9", b" \xe2\x80", b"\xa6", b"\xf0\x9f", b"\x99\x82", b"z\xc3", b"\xa9b"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.CHUNKS[i] for i in ids).decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(ChunkTokenizer.CHUNKS) - 1), max_size=4),
       st.lists(st.integers(0, len(ChunkTokenizer.CHUNKS) - 1), min_size=1, max_size=10))
def test_text_decoded_at_the_end_equals_streamed_text(prompt, output):
    """Offline requests decode once at the end. At a stop (EOS) that must give what `add` had emitted
    token by token; at a length cut-off, that plus `flush`."""
    tok = ChunkTokenizer()
    streamed = IncrementalDetokenizer(tok, prompt)
    text = "".join(streamed.add(t) for t in output)
    at_stop, at_length = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
    at_stop.ids += output
    at_length.ids += output
    assert at_stop.emitted_by_add() == text
    assert at_length.flush() == text + streamed.flush()


@pytest.mark.parametrize("kept", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_checkpoint_with_either_name(tmp_path, kept):
    """A tied checkpoint may store the shared matrix under either name (safetensors' save_model keeps
    lm_head.weight); both load, and the model gives transformers' logits."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=True)).eval()
    hf.save_pretrained(str(tmp_path))
    shared = hf.model.embed_tokens.weight.detach().clone()
    rewrite_weights(tmp_path, lambda t: (t.pop("lm_head.weight", None), t.pop("model.embed_tokens.weight", None),
                                         t.update({kept: shared})))
    model, _, _ = load_model(str(tmp_path))
    assert torch.equal(model.model.embed_tokens.weight, shared)
    from flexengine import LLM, SamplingParams
    ids = [5, 17, 99, 3]
    out = LLM(str(tmp_path), num_kv_blocks=16, block_size=16).generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, attention_mask=torch.ones(1, 4))
    assert out[0].outputs[0].token_ids == ref[0, 4:].tolist()
