"""make-model presets and the embedded default model."""
from __future__ import annotations

import argparse
import hashlib
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flexengine.models import presets
from flexengine.models.default_model import default_model_path
from flexengine.models.loader import build_model, checkpoint_layout, load_model
from flexengine.models.registry import get_model_class
from harness import greedy_generate


def written_config(name, tmp_path, **kw):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(presets.preset_config(name, **kw)))
    return AutoConfig.from_pretrained(str(path))


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_shapes_match_transformers(name, tmp_path):
    """Our model, built on meta from the preset's config.json, expects exactly the tensors (names
    and shapes) of transformers' own model of that config, which is what make-model writes."""
    config = written_config(name, tmp_path)
    ours = checkpoint_layout(build_model(get_model_class(config), config, torch.bfloat16, "meta"))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    theirs = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert {n: t.shape for n, t in ours.items()} == theirs


def test_published_values():
    p = presets.PRESETS
    assert p["llama-3.2-1b"]["rope_scaling"]["factor"] == 32.0 and p["llama-3.2-1b"]["tie_word_embeddings"]
    assert p["llama-3.1-8b"]["rope_scaling"]["factor"] == 8.0 and p["llama-3.1-8b"]["intermediate_size"] == 14336
    assert p["qwen3-0.6b"]["head_dim"] == 128 and p["qwen3-8b"]["num_hidden_layers"] == 36
    assert p["gemma-2-2b"]["final_logit_softcapping"] == 30.0 and p["gemma-2-2b"]["num_key_value_heads"] == 4
    assert p["mistral-7b"]["sliding_window"] == 4096 and p["mistral-7b"]["vocab_size"] == 32000


def run_make_model(argv):
    parser = argparse.ArgumentParser()
    presets.add_arguments(parser)
    return presets.main(parser.parse_args(argv))


def test_small_write_loads_and_matches_transformers(tmp_path, monkeypatch):
    out = tmp_path / "qwen3"
    monkeypatch.setattr(presets, "SHARD_BYTES", 128 << 20)  # also exercise the sharded writer
    assert run_make_model(["--preset", "qwen3-0.6b", "--out", str(out), "--num-layers", "1", "--seed", "3"]) == 0
    assert os.path.exists(out / "model.safetensors.index.json")
    model, config, tokenizer = load_model(str(out), dtype="float32")
    assert config.num_hidden_layers == 1 and tokenizer is not None and config.dtype == torch.bfloat16
    norm = model.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    prompt = tokenizer.encode("hello paged world")
    tokens, logprobs = greedy_generate(model, prompt, 2, block_size=16)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    chosen = ref[torch.arange(2), torch.tensor(tokens)]
    assert (chosen - torch.tensor(logprobs)).abs().max() < 2e-3
    assert (chosen - ref.max(-1).values).abs().max() < 1e-4  # ours picked transformers' argmax (or a tie)


def test_plan_shards():
    assert presets.plan_shards({"a": 5, "b": 5, "c": 1, "d": 9}, max_bytes=10) == [["a", "b"], ["c", "d"]]
    assert presets.plan_shards({"big": 50}, max_bytes=10) == [["big"]]


def test_gemma_norms_written_as_zero(tmp_path):
    config = written_config("gemma-2-2b", tmp_path, num_layers=1)
    model = build_model(get_model_class(config), config, torch.bfloat16, "meta")
    kinds = presets.tensor_kinds(model)
    assert kinds["model.norm.weight"] == "zeros" and kinds["model.layers.0.pre_feedforward_layernorm.weight"] == "zeros"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "normal"


def file_hashes(path):
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


def test_default_model_deterministic_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXENGINE_CACHE_DIR", str(tmp_path / "a"))
    first = default_model_path()
    assert first.startswith(str(tmp_path / "a")) and default_model_path() == first
    monkeypatch.setenv("FLEXENGINE_CACHE_DIR", str(tmp_path / "b"))
    second = default_model_path()
    assert file_hashes(first) == file_hashes(second)
    assert [f for f in os.listdir(tmp_path / "a") if f.startswith(".")] == []  # no temp dir left behind
    model, config, tokenizer = load_model(first)
    assert config.architectures == ["LlamaForCausalLM"] and next(model.parameters()).dtype == torch.float32
    assert config.vocab_size == len(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<bos>user: Hi!\nassistant: "
    prompt = tokenizer.encode(text, add_special_tokens=False)
    tokens, _ = greedy_generate(model, prompt, 32)
    assert len(set(tokens)) > 8, tokens
    assert tokenizer.eos_token_id not in tokens
