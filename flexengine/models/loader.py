"""load_model: config.json + safetensors (+ tokenizer) → (model, hf_config, tokenizer).

The model is built on the meta device, materialised empty on the target device in the target dtype,
and each checkpoint tensor is copied straight into its (slice of a) parameter, one at a time, so the
weights are never held twice.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from ..config import resolve_device
from ..layers.linear import MergedLinear
from ..parallel.shard import shard_layout
from ..tokenizer import load_tokenizer
from .registry import get_model_class

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
ACCEPTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Checkpoint tensors that carry nothing we need (old Llama exports saved their rotary tables).
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


@dataclass
class TensorTarget:
    """Where one checkpoint tensor goes: a parameter, optionally only some of its rows."""
    param: str
    rows: slice | None
    shape: tuple[int, ...]              # the checkpoint tensor's (whole) shape
    source: tuple | None = None         # tensor parallelism: the index of the part this rank reads


def resolve_model_path(model: str) -> str:
    """A local directory, or a hub id resolved through the local Hugging Face cache (then the hub)."""
    model = os.fspath(model)
    if os.path.isdir(model):
        return model
    if os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1:
        raise ValueError(f"model path {model!r} is not a directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return snapshot_download(model, local_files_only=True, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError:
        pass  # not cached: try the hub below
    try:
        return snapshot_download(model, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # offline, no network, unknown repo, gated...: all mean "cannot get it"
        raise ValueError(f"model {model!r} is not a local directory and is not cached in the Hugging Face "
                         f"cache, and downloading it failed ({type(e).__name__}: {e})") from e


def resolve_dtype(dtype, hf_config=None, header_dtypes=()) -> torch.dtype:
    """'auto' → the checkpoint's dtype (config, else its first floating tensor, else float32)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; accepted: {', '.join(ACCEPTED_DTYPES)}")
        return dtype
    if not isinstance(dtype, str) or (dtype != "auto" and dtype not in DTYPES):
        raise ValueError(f"unsupported dtype {dtype!r}; accepted: {', '.join(ACCEPTED_DTYPES)} "
                         f"(or a torch.dtype among float32, bfloat16, float16)")
    if dtype != "auto":
        return DTYPES[dtype]
    if hf_config is None:
        return torch.float32
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared.replace("torch.", ""))
    if isinstance(declared, torch.dtype) and declared in DTYPES.values():
        return declared
    for d in header_dtypes:
        if d in DTYPES.values():
            return d
    return torch.float32


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(path, name)):
                raise ValueError(f"{index} lists shard {name!r}, which is missing")
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(path, f) for f in found]
    others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
    hint = f" (found {', '.join(others)}; only safetensors and GGUF are read)" if others else ""
    raise ValueError(f"no safetensors weights in {path}{hint}")


def open_safetensors(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"cannot read {file}: truncated or corrupt safetensors file ({e})") from e


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def read_headers(files: list[str]) -> dict[str, tuple[str, tuple[int, ...], torch.dtype | None]]:
    """Checkpoint tensor name → (file, shape, dtype or None if not floating), from the headers only."""
    headers = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                if name in headers:
                    raise ValueError(f"tensor {name!r} appears in both {headers[name][0]} and {file}")
                headers[name] = (file, tuple(sl.get_shape()), dtype)
    return headers


def checkpoint_layout(model: torch.nn.Module) -> dict[str, TensorTarget]:
    """Every checkpoint tensor the model needs, with its shape: fused projections are listed as
    their separate checkpoint tensors (q_proj/k_proj/v_proj, gate_proj/up_proj)."""
    layout = {}
    fused = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for pname, p in model.named_parameters():
        owner, _, leaf = pname.rpartition(".")
        if owner in fused:
            parent = owner.rpartition(".")[0]
            for shard, rows in fused[owner].shard_rows().items():
                shape = (rows.stop - rows.start, *p.shape[1:])
                layout[f"{parent}.{shard}.{leaf}"] = TensorTarget(pname, rows, shape)
        else:
            layout[pname] = TensorTarget(pname, None, tuple(p.shape))
    return shard_layout(model, layout)  # a rank's slices under tensor parallelism; as is at TP=1


def is_harmless_extra(name: str, model) -> bool:
    tied = getattr(getattr(model, "spec", None), "tie_word_embeddings", False)
    return name.endswith(HARMLESS_SUFFIXES) or (tied and name == "lm_head.weight")


def tied_renames(layout: dict[str, TensorTarget], headers: dict, model) -> dict[str, str]:
    """{checkpoint name: layout name} for a tied checkpoint that stores the shared matrix only as
    lm_head.weight (what safetensors' save_model keeps): it is the embedding."""
    tied = getattr(getattr(model, "spec", None), "tie_word_embeddings", False)
    embed = next((n for n in layout if n.endswith("embed_tokens.weight")), None)
    if tied and embed and embed not in headers and "lm_head.weight" in headers:
        return {"lm_head.weight": embed}
    return {}


def check_tensors(layout: dict[str, TensorTarget], headers: dict, model) -> None:
    unexpected = [n for n in headers if n not in layout and not is_harmless_extra(n, model)]
    if unexpected:
        raise ValueError(f"unexpected tensor(s) in checkpoint: {', '.join(sorted(unexpected)[:10])}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
    missing = [n for n in layout if n not in headers]
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    for name, target in layout.items():
        shape = headers[name][1]
        if shape != target.shape:
            raise ValueError(f"tensor {name!r} has shape {list(shape)} in the checkpoint, expected {list(target.shape)}")


def build_model(cls, hf_config, dtype: torch.dtype, device) -> torch.nn.Module:
    """Construct on meta (no memory, no init), then allocate empty parameters on `device` in `dtype`."""
    with torch.device("meta"):
        model = cls(hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_buffers()
    return model.requires_grad_(False).eval()


@torch.no_grad()
def load_weights(model: torch.nn.Module, files: list[str], headers: dict | None = None) -> None:
    """Check every name and shape first (nothing is copied into a half-valid model), then copy."""
    layout = checkpoint_layout(model)
    headers = headers if headers is not None else read_headers(files)
    renames = tied_renames(layout, headers, model)
    check_tensors(layout, {renames.get(n, n): h for n, h in headers.items()}, model)
    params = dict(model.named_parameters())
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if renames.get(name, name) not in layout:
                    continue
                target = layout[renames.get(name, name)]
                dest = params[target.param]
                dest = dest[target.rows] if target.rows is not None else dest
                dest.copy_(f.get_tensor(name) if target.source is None else f.get_slice(name)[target.source])


def load_model(model: str, dtype="auto", device="cpu", trust_remote_code: bool = False):
    """(model, hf_config, tokenizer or None) for a local checkpoint directory, a GGUF file (or a directory
    holding one), a cached hub id, or a named model flexengine fetches (default_model.NAMED_MODELS)."""
    resolve_dtype(dtype)  # a bad dtype fails before any file is read
    from .default_model import resolve_named_model
    from .gguf import find_gguf, load_gguf
    model = resolve_named_model(model)
    gguf_file = find_gguf(model)
    if gguf_file is not None:
        return load_gguf(gguf_file, dtype, device)
    path = resolve_model_path(model)
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    cls = get_model_class(hf_config)
    files = safetensors_files(path)
    headers = read_headers(files)
    torch_dtype = resolve_dtype(dtype, hf_config, [h[2] for h in headers.values()])
    net = build_model(cls, hf_config, torch_dtype, resolve_device(device))
    load_weights(net, files, headers)
    return net, hf_config, load_tokenizer(path, trust_remote_code=trust_remote_code)
