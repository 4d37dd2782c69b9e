"""GGUF checkpoints: config, tokenizer (with its chat template) and weights from one .gguf file.

A GGUF file holds llama.cpp's names and layouts; this file turns them into a transformers config and
the checkpoint names the loader already knows (model.layers.N.self_attn.q_proj.weight ...), and
dequantizes each tensor with the `gguf` package's numpy code as it is copied into the model, one
tensor at a time. Two layout differences from a transformers checkpoint:
- llama.cpp's converter reorders the rows of q_proj/k_proj of "llama" models (Llama, Mistral, SmolLM):
  within each head, the two rotary halves [x0..x(d/2-1), y0..y(d/2-1)] become interleaved pairs
  [x0, y0, x1, y1, ...], because ggml's rope rotates adjacent pairs. `unpermute_rotary_rows` undoes it.
  Qwen and Gemma GGUFs keep transformers' order (llama.cpp's "neox" rope).
- Gemma's RMSNorm weights are stored as w + 1 (ggml multiplies by the weight alone); ours store w.
"""
from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import torch

# general.architecture → the transformers architecture that runs it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # where transformers' model_type differs from the GGUF name
PERMUTED_QK = ("llama", "mistral")  # converted with llama.cpp's q/k row permutation
GEMMA = ("gemma2", "gemma3")
# Layer counts of the 27B Gemmas, which llama.cpp scales attention by 1/sqrt(hidden/heads), not 1/sqrt(head_dim).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# GGUF tensor name (after "blk.N.") → transformers' name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms per layer: ffn_norm is the one before the MLP there.
GEMMA_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def require_gguf():
    from .default_model import ModelUnavailableError  # a ValueError the CLI shows as one line
    try:
        import gguf
    except ModuleNotFoundError:
        raise ModelUnavailableError("reading GGUF files needs the gguf package: pip install 'flexengine[gguf]'") \
            from None
    return gguf


def find_gguf(model) -> str | None:
    """The .gguf file `model` names: the path of one, or a directory whose only weights are one .gguf
    (a directory with safetensors stays a safetensors checkpoint). None otherwise."""
    model = os.fspath(model)
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"GGUF file {model!r} does not exist")
        return model
    if not os.path.isdir(model) or any(f.endswith(".safetensors") for f in os.listdir(model)):
        return None
    found = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{model} holds several GGUF files ({', '.join(found)}): pass the path of one")
    return os.path.join(model, found[0]) if found else None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> dict:
    """config.json's fields for the file's architecture, from its metadata and tensor shapes."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError("GGUF file has no token_embd.weight (the token embedding)")
    get = lambda key, default=None: field(reader, f"{arch}.{key}", default)  # noqa: E731
    required = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count",
                "attention.layer_norm_rms_epsilon")
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise ValueError(f"GGUF metadata lacks {', '.join(missing)}")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    # Llama-family files often give the head size only as the rotary dimension (the whole head there).
    rotary = get("rope.dimension_count") if arch in PERMUTED_QK else None
    head_dim = get("attention.key_length") or rotary or hidden // heads
    layers = get("block_count")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer in some files: one value is all a decoder here can have
        if len(set(kv_heads)) != 1:
            raise ValueError(f"GGUF gives different KV head counts per layer ({sorted(set(kv_heads))}), unsupported")
        kv_heads = kv_heads[0]
    config = dict(
        architectures=[ARCHITECTURES[arch]], model_type=MODEL_TYPES.get(arch, arch),
        vocab_size=int(names["token_embd.weight"].shape[1]), hidden_size=hidden,
        intermediate_size=get("feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=get("context_length", 2048), rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0), tie_word_embeddings="output.weight" not in names,
        torch_dtype="float32",
    )
    scaling = get("rope.scaling.type")
    if "rope_freqs.weight" in names:
        config["rope_scaling"] = llama3_scaling(dequantized(names["rope_freqs.weight"], torch.float32),
                                                head_dim, config["rope_theta"])
    elif scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"unsupported GGUF rope scaling {scaling!r} (only linear is read)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["attention_bias"] = arch == "qwen2"
    if arch in GEMMA:
        config.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                      sliding_window=get("attention.sliding_window"),
                      query_pre_attn_scalar=hidden // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim)
        if arch == "gemma2":  # transformers' Gemma 2 defaults where the file says nothing
            config.update(attn_logit_softcapping=get("attn_logit_softcapping", 50.0),
                          final_logit_softcapping=get("final_logit_softcapping", 30.0))
        else:
            config.update(rope_local_base_freq=10000.0, sliding_window_pattern=6)
    for key, ours in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[ours] = int(value)
    return config


def llama3_scaling(freq_factors: torch.Tensor, head_dim: int, theta: float) -> dict | None:
    """The rope_scaling behind llama.cpp's rope_freqs tensor. Its converter writes Llama 3.1's scaling as
    one divisor per rotary frequency, computed from (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); Llama 3.1 and 3.2 use 1, 4 and 8192 for the last three. Those
    are tried (then other power-of-two contexts), and the one that reproduces the tensor is used."""
    from ..layers.rotary import default_inv_freq, llama3_inv_freq
    if bool((freq_factors == 1).all()):
        return None
    factor = float(freq_factors.max())
    base = default_inv_freq(head_dim, theta)
    if freq_factors.shape != base.shape:
        raise ValueError(f"rope_freqs has {freq_factors.numel()} entries, expected {base.numel()} (head_dim / 2)")
    for original in [8192] + [2 ** k for k in range(4, 21)]:
        scaled = llama3_inv_freq(base, factor, 1.0, 4.0, original)
        if torch.allclose(base / scaled, freq_factors, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": original}
    raise ValueError("this GGUF's rope_freqs tensor matches no Llama 3 rope scaling (low_freq_factor 1, "
                     "high_freq_factor 4): unsupported rotary scaling")


def hf_name(gguf_name: str, arch: str) -> str:
    """llama.cpp's tensor name → transformers'; ValueError for a tensor no supported model has."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem in TOP_TENSORS:
        return f"{TOP_TENSORS[stem]}.{leaf}"
    parts = stem.split(".")
    table = GEMMA_LAYER_TENSORS if arch in GEMMA else LAYER_TENSORS
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{leaf}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (weight or bias) from llama.cpp's interleaved rotary pairs back to
    transformers' two halves per head: row (h, i, j) of the file, j the pair member, is row (h, j, i)."""
    rows = w.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized(tensor, dtype: torch.dtype) -> torch.Tensor:
    """One reader tensor in transformers' shape (GGUF lists dims innermost first) as `dtype`."""
    gguf = require_gguf()
    kind = tensor.tensor_type
    types = gguf.GGMLQuantizationType
    if kind in (types.F32, types.F16):
        data = np.array(tensor.data)  # a copy: the reader's memory map is read-only
    else:
        try:
            data = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise ValueError(f"tensor {tensor.name!r} uses GGUF type {kind.name}, which the gguf package cannot "
                             f"dequantize") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(data).reshape(shape).to(dtype)


def check_quant_types(reader) -> None:
    """Every tensor's type has a numpy dequantizer: fail before anything is allocated."""
    gguf = require_gguf()
    types = gguf.GGMLQuantizationType
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in (types.F32, types.F16)
                  and not quant_supported(gguf, t.tensor_type)})
    if bad:
        raise ValueError(f"unsupported GGUF quantization type(s): {', '.join(bad)} (the gguf package has no "
                         f"dequantization for them)")


def quant_supported(gguf, kind) -> bool:
    probe = np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), dtype=np.uint8)
    try:
        gguf.quants.dequantize(probe, kind)
    except NotImplementedError:
        return False
    return True


def gguf_dtype(reader, dtype, device) -> torch.dtype:
    """'auto': the file's float type; for quantized files bfloat16 on a GPU, float32 elsewhere (CPU
    half-precision matmuls are slow)."""
    from .loader import resolve_dtype
    if dtype != "auto":
        return resolve_dtype(dtype)
    gguf = require_gguf()
    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if kinds == {gguf.GGMLQuantizationType.F16}:
        return torch.float16
    if kinds == {gguf.GGMLQuantizationType.BF16}:
        return torch.bfloat16
    if kinds <= {gguf.GGMLQuantizationType.F32}:
        return torch.float32
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@torch.no_grad()
def load_gguf_weights(model: torch.nn.Module, reader, arch: str, config: dict) -> None:
    """Check every name and shape first, then dequantize and copy one tensor at a time."""
    from .loader import check_tensors, checkpoint_layout

    layout = checkpoint_layout(model)
    # rope_freqs became the config's rope_scaling (gguf_config)
    names = {hf_name(t.name, arch): t for t in reader.tensors if t.name != "rope_freqs.weight"}
    headers = {n: (None, tuple(int(d) for d in reversed(t.shape)), None) for n, t in names.items()}
    check_tensors(layout, headers, model)
    params = dict(model.named_parameters())
    dtype = next(model.parameters()).dtype
    for name, tensor in names.items():
        if name not in layout:
            continue  # a tied lm_head the file stores anyway: the embedding is the one used
        w = dequantized(tensor, torch.float32)
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rotary_rows(w, config["num_attention_heads"])
        elif arch in PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rotary_rows(w, config["num_key_value_heads"])
        if arch in GEMMA and name.endswith("norm.weight"):
            w = w - 1
        target = layout[name]
        assert target.source is None, "tensor parallelism refuses GGUF files (parallel/launch.py)"
        dest = params[target.param]
        dest = dest[target.rows] if target.rows is not None else dest
        dest.copy_(w.to(dtype))


def load_gguf_tokenizer(file: str):
    """transformers' own GGUF tokenizer conversion (BPE and SentencePiece vocabularies, chat template
    included). The conversion parses the whole vocabulary again (seconds for 50k tokens), so its result
    is saved in the flexengine cache, keyed by the file's path, size and modification time."""
    from transformers import AutoTokenizer

    from ..config import cache_dir
    stat = os.stat(file)
    key = hashlib.sha256(f"{os.path.abspath(file)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    saved = os.path.join(cache_dir(), "gguf-tokenizers", key)
    if os.path.exists(os.path.join(saved, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(file)), gguf_file=os.path.basename(file))
    tmp = f"{saved}.{os.getpid()}.tmp"
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, saved)
    except OSError:  # another process saved it first (a directory is not replaced)
        shutil.rmtree(tmp)
    return AutoTokenizer.from_pretrained(saved)


def load_gguf(file: str, dtype="auto", device="cpu"):
    """(model, hf_config, tokenizer) from one GGUF file."""
    from ..config import resolve_device
    from .loader import build_model
    from .presets import hf_config_of
    from .registry import get_model_class

    gguf = require_gguf()
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"cannot read {file}: not a valid GGUF file ({e})") from e
    config = gguf_config(reader)
    check_quant_types(reader)
    device = resolve_device(device)
    torch_dtype = gguf_dtype(reader, dtype, device)
    config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    hf_config = hf_config_of(config)
    model = build_model(get_model_class(hf_config), hf_config, torch_dtype, device)
    load_gguf_weights(model, reader, field(reader, "general.architecture"), config)
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    return model, hf_config, load_gguf_tokenizer(file) if has_vocab else None
