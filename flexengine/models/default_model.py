"""The embedded default model: a tiny random Llama with the byte-level tokenizer, built offline on
first use into the flexengine cache (deterministically: same seed, same bytes)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from ..config import cache_dir
from ..tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer

NAME = "default-model-v1"
SEED = 0
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, initializer_range=0.02,
    bos_token_id=256, eos_token_id=257, pad_token_id=258, torch_dtype="float32",
)
# Larger than transformers' 0.02 init, so the random model's greedy output wanders over many bytes
# instead of settling on one.
WEIGHT_STD = 0.5


def default_weights() -> dict[str, torch.Tensor]:
    """fp32 weights from a fixed seed: normal matrices and unit norms. Output rows are zeroed except
    for printable ASCII, so greedy text is readable gibberish, never cut short by a random <eos>."""
    from .loader import build_model, checkpoint_layout
    from .presets import hf_config_of, tensor_kinds
    from .registry import get_model_class

    hf_config = hf_config_of(CONFIG)
    model = build_model(get_model_class(hf_config), hf_config, torch.float32, "meta")
    layout, kinds = checkpoint_layout(model), tensor_kinds(model)
    gen = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, target in layout.items():
        kind = kinds[name]
        if kind == "normal":
            weights[name] = torch.empty(target.shape).normal_(0.0, WEIGHT_STD, generator=gen)
        else:
            weights[name] = torch.full(target.shape, 1.0 if kind == "ones" else 0.0)
    printable = torch.zeros(BYTE_VOCAB_SIZE, dtype=torch.bool)
    printable[ord(" "):ord("~") + 1] = True
    weights["lm_head.weight"][~printable] = 0.0
    return weights


def write_default_model(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    save_file(default_weights(), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
    save_byte_tokenizer(out)


def default_model_path() -> str:
    """The default model's directory, building it first if this cache has none."""
    path = os.path.join(cache_dir(), NAME)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache_dir())
    write_default_model(tmp)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other
    try:
        os.rename(tmp, path)  # atomic: readers see no directory or a complete one
    except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
        shutil.rmtree(tmp)  # another process finished first; theirs is identical
    return path
