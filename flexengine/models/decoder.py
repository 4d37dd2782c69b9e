"""The generic pre-norm decoder every family here is a configuration of.

A family file turns its transformers config into a `DecoderSpec`; `DecoderForCausalLM` builds the
modules with the checkpoint's names (model.embed_tokens, model.layers.N.self_attn..., lm_head), with
q/k/v and gate/up fused into one matmul each (the loader fills them from the separate tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention.kv_cache import write_kv
from ..attention.layer import Attention
from ..compile import fused
from ..attention.metadata import AttentionMetadata
from ..layers.activation import ActAndMul
from ..layers import gemv as one_row_gemv
from ..layers.gemv import gate_up_silu, gemv, head_rows, norm_gemv, norm_gemv_rope, one_row, takes_gate_up_silu
from ..layers.linear import down_split, summed, takes_down_split
from ..layers.norms import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary, rotary_store, stores_rotary
from ..masks import causal, sliding_window, softcap
from ..parallel.collectives import broadcast_from_first
from ..parallel.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                               VocabParallelEmbedding, divide, gather_vocab, kv_heads_of_rank)
from ..parallel.state import tp_group

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types values


@dataclass
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str
    layer_types: list[str]                 # one of FULL / SLIDING per layer
    rope: dict[str, dict]                  # layer type → transformers rope_parameters dict
    sliding_window: int | None = None
    attn_scale: float | None = None        # None → head_dim ** -0.5
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False           # Gemma: norms after attention and MLP as well as before
    norm_unit_offset: bool = False         # Gemma: RMSNorm weight stored as w - 1
    embed_scale: float | None = None       # Gemma: embeddings times sqrt(hidden), rounded to the dtype
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tie_word_embeddings: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert set(self.layer_types) <= {FULL, SLIDING}, self.layer_types
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("config has sliding_attention layers but no sliding_window")
        for kind in set(self.layer_types):
            assert kind in self.rope, f"no rope parameters for {kind}"


class DecoderAttention(nn.Module):
    """Under tensor parallelism: this rank's query and KV heads (q/k/v column-parallel, o_proj row-parallel)."""

    def __init__(self, spec: DecoderSpec, attn: Attention):
        super().__init__()
        Hq, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, Hq, Hkv, D, bias=spec.qkv_bias)
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.num_heads * D, self.qkv_proj.num_kv_heads * D, D
        self.o_proj = RowParallelLinear(Hq * D, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(D, spec.rms_norm_eps, spec.norm_unit_offset)
            self.k_norm = RMSNorm(D, spec.rms_norm_eps, spec.norm_unit_offset)
        self.attn = attn

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] → q [T, Hq, D], k and v [T, Hkv, D], rotary applied."""
        return self.heads(self.qkv_proj(x), cos, sin)

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The projection's output [T, (Hq + 2 Hkv) D] → q, k, v as qkv() gives them."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(T, -1, self.head_dim), k.view(T, -1, self.head_dim), v.view(T, -1, self.head_dim)
        if hasattr(self, "q_norm"):  # per head, before rotary (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(o.shape[0], self.q_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        return self.out(self.attn(*self.qkv(x, cos, sin), meta))


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        I = spec.intermediate_size  # noqa: E741
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, {"gate_proj": I, "up_proj": I},
                                                       bias=spec.mlp_bias)
        self.act = ActAndMul(spec.activation)
        self.down_proj = RowParallelLinear(I, spec.hidden_size, bias=spec.mlp_bias)
        # SiLU's gating in the projection's kernel: the one-row path's, and gate_up_silu's where bias-free
        self.gated_silu = self.act.name in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activated(x))

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input: act(gate) * up."""
        if self.gated_silu and self.gate_up_proj.bias is None and takes_gate_up_silu(x):  # (layers/gemv.py)
            return gate_up_silu(x, self.gate_up_proj.weight)
        return self.act(self.gate_up_proj(x))

    def one_row(self, x: torch.Tensor, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """forward(norm(x + h)) for one row: the sum and the norm inside the gate/up projection's kernel, and SiLU's
        gating in its epilogue (another activation keeps its own kernel)."""
        out = norm_gemv(x, h, None, norm.weight, self.gate_up_proj.weight, norm.eps, self.gated_silu)[0]
        return self.down_proj(out if self.gated_silu else self.act(out))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_type: str, attn: Attention):
        super().__init__()
        norm = lambda: RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_unit_offset)  # noqa: E731
        self.layer_type = layer_type
        self.self_attn = DecoderAttention(spec, attn)
        self.mlp = DecoderMLP(spec)
        self.input_layernorm = norm()
        # Llama's post_attention_layernorm is the pre-MLP norm; Gemma's really follows attention.
        self.post_attention_layernorm = norm()
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # One-row steps (batch-1 decode) fold the norms into the projections after them where the norm is
        # plain (not Gemma's 1 + w) and the projection has no bias (layers/gemv.py).
        plain = not spec.norm_unit_offset
        self.fold_qkv = plain and not spec.qkv_bias
        self.fold_mlp = plain and not spec.mlp_bias and not self.sandwich
        # and rotary and the K/V store into q/k/v's epilogue (layers/gemv.py's ROPE_EPILOGUE), where no per-head norm
        # comes between (Qwen3's) and a program's two rotary pairs fit one head (D/2 even)
        self.fold_rope = one_row_gemv.ROPE_EPILOGUE and self.fold_qkv and not spec.qk_norm and spec.head_dim % 4 == 0
        # steps of more rows: rotary and the K/V store in one kernel after the projection (layers/rotary.py), likewise
        # where no per-head norm comes between
        self.rotary_store = not spec.qk_norm
        # and the down projection's two partial sums, which the next norm adds (layers/linear.py's DOWN_SPLIT_ROWS),
        # where the MLP's addition goes straight to that norm: no bias, one GPU (sandwich layers return before it)
        self.split_down = not spec.mlp_bias and tp_group().size == 1

    # The layer's work on either side of attention is two compiled regions on the CUDA engine (one
    # Inductor graph each, dynamic in T, shared by every layer); paged attention stays between them.
    # The residual stream crosses layers un-summed: a layer hands on the stream as it entered plus its two
    # additions (attention's and the MLP's), and the next layer adds them inside its first norm's kernel. A
    # sum that ended a region would be stored by a kernel of its own (or, on one GPU, by cuBLAS's addmm and
    # a copy launch), one or two launches a layer at batch 1, where every launch costs about 1 µs of gap.
    @fused(writes_kv_cache=True)
    def attention_inputs(self, x, attn_delta, mlp_delta, cos, sin, k_cache, v_cache, slot_mapping):
        """→ (the queries, the residual stream): x plus the last layer's additions (None in the first layer).
        The step's new K/V go into the paged cache here, so that Inductor stores them from the rotary kernel
        instead of two copy launches after it (the caches are separate tensors for this: attention/kv_cache.py)."""
        if self.fold_qkv and one_row(x):
            norm, attn = self.input_layernorm, self.self_attn
            if self.fold_rope and k_cache.dtype == x.dtype:  # one kernel: the residual sum to the cache store
                q, x = norm_gemv_rope(x, attn_delta, mlp_delta, norm.weight, attn.qkv_proj.weight, norm.eps, cos, sin,
                                      slot_mapping, k_cache, v_cache, attn.qkv_proj.num_heads,
                                      attn.qkv_proj.num_kv_heads)
                return q.view(1, -1, attn.head_dim), x
            qkv, x = norm_gemv(x, attn_delta, mlp_delta, norm.weight, attn.qkv_proj.weight, norm.eps)
            q, k, v = attn.heads(qkv, cos, sin)
        else:
            if attn_delta is not None:
                x = x + attn_delta + summed(mlp_delta, x.dtype)
            attn = self.self_attn
            if self.rotary_store and stores_rotary(x) and k_cache.dtype == x.dtype:  # rotary and the store: one kernel
                q = rotary_store(attn.qkv_proj(self.input_layernorm(x)), cos, sin, slot_mapping, k_cache, v_cache,
                                 attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads)
                return q, x
            q, k, v = attn.qkv(self.input_layernorm(x), cos, sin)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q, x

    @fused
    def attention_output_and_mlp(self, x, o):
        """→ (attention's addition to the residual stream x, the MLP's): the next layer or the final norm adds
        them. x + attention's addition is consumed by the norm alone, so Inductor keeps it in that kernel. The MLP's
        may be the down projection's two float32 partial sums ([2, T, H], DOWN_SPLIT_ROWS), `summed` where added."""
        h = self.self_attn.out(o)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
            return h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x + h)))
        if self.fold_mlp and one_row(x):
            return h, self.mlp.one_row(x, h, self.post_attention_layernorm)
        if self.split_down and takes_down_split(x):  # [2, T, H] float32: the next norm's kernel adds them
            return h, down_split(self.mlp.activated(self.post_attention_layernorm(x + h)), self.mlp.down_proj.weight)
        return h, self.mlp(self.post_attention_layernorm(x + h))

    def forward(self, x, deltas, cos, sin, meta):
        """(residual stream, the last layer's additions or (None, None)) → the same for the next layer."""
        attn = self.self_attn.attn
        q, x = self.attention_inputs(x, *deltas, cos, sin, attn.k_cache, attn.v_cache, meta.slot_mapping)
        return x, self.attention_output_and_mlp(x, attn.attend(q, meta))


def make_attention_layers(spec: DecoderSpec) -> list[Attention]:
    """One Attention per layer; every layer of a kind shares the SAME mask/score objects, so the
    metadata builder makes one BlockMask per kind and step, not one per layer."""
    scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim ** -0.5
    score = softcap(spec.attn_softcap) if spec.attn_softcap is not None else None
    masks = {FULL: (causal, "global")}
    if SLIDING in spec.layer_types:
        masks[SLIDING] = (sliding_window(spec.sliding_window), "sliding")
    # Tensor parallelism: this rank's heads (QKVParallelLinear checks that they divide evenly).
    tp = tp_group()
    heads = divide(spec.num_heads, tp.size, "the number of attention heads")
    kv_heads = kv_heads_of_rank(spec.num_kv_heads, tp.rank, tp.size)[1]
    layers = [Attention(heads, kv_heads, spec.head_dim, scale, mask_mod=masks[t][0], score_mod=score, kind=masks[t][1])
              for t in spec.layer_types]
    for a in layers:  # a mod sees global head indices (parallel/heads.py): rank r's head 0 is head r * heads
        a.total_heads, a.head_offset = spec.num_heads, tp.rank * heads
    return layers


# Whether the first layer takes zero additions (first_deltas) instead of None: it then runs on the later layers'
# compiled graphs, where None made attention_inputs two graphs of its own (combo and plain: ~2 s of a fresh start, issue
# 24), for two memsets a step: batch 1, 8 and 32 within 0.2% of None's step on one H200, 2 graphs and 2.3 s fewer at a
# fresh start (docs/benchmarks.md, session 52).
ZERO_FIRST_DELTAS = True


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        attns = make_attention_layers(spec)
        self.layers = nn.ModuleList(DecoderLayer(spec, t, a) for t, a in zip(spec.layer_types, attns))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_unit_offset)
        # One rotary per distinct rope_parameters (Gemma 3's local layers use another theta).
        kinds = sorted(set(spec.layer_types))
        self.rope_key = {t: next(k for k in kinds if spec.rope[k] == spec.rope[t]) for t in kinds}
        self.rotary = nn.ModuleDict({k: RotaryEmbedding(spec.head_dim, spec.rope[k]) for k in set(self.rope_key.values())})
        self.embed_scale_value = spec.embed_scale
        self.embed_scale: float | None = None  # set by reset_buffers, once the dtype is known
        self.tp = tp_group()

    def reset_buffers(self) -> None:
        self.embed_tokens.zero_padding()
        for rope in self.rotary.values():
            rope.reset_buffers()
        if self.embed_scale_value is not None:
            # transformers multiplies by the normalizer cast to the weights' dtype (sqrt(3072) → 55.5 in bf16).
            self.embed_scale = float(torch.tensor(self.embed_scale_value, dtype=self.embed_tokens.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.tp.size > 1:  # rank 0's ids, which may have been fed from its own samples on the device
            input_ids = broadcast_from_first(input_ids, self.tp.device)
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {t: r(positions, x.dtype) for t, r in self.rotary.items()}
        deltas = self.first_deltas(x) if ZERO_FIRST_DELTAS else (None, None)
        for layer in self.layers:
            cos, sin = rope[self.rope_key[layer.layer_type]]
            x, deltas = layer(x, deltas, cos, sin, meta)
        return self.final_norm(x, *deltas)

    def first_deltas(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero additions for the first layer, in x's shape and dtype: the later layers' graph for such additions
        serves every row count past one (the down projection's split partial sums are a graph of their own, which
        the first layer need not share), and the batch-1 one (two tensors: one passed twice would alias)."""
        return torch.zeros_like(x), torch.zeros_like(x)

    @fused
    def final_norm(self, x, attn_delta, mlp_delta):
        return self.norm(x + attn_delta + summed(mlp_delta, x.dtype))


class DecoderForCausalLM(nn.Module):
    """model(input_ids [T], positions [T], meta) → hidden [T, H]; compute_logits(rows) → fp32 logits."""

    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size)

    def reset_buffers(self) -> None:
        """Rebuild non-checkpoint state (rotary frequencies, embedding scale) on the current device."""
        self.model.reset_buffers()
        if not self.spec.tie_word_embeddings:
            self.lm_head.zero_padding()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def one_row_projections(self) -> list[str]:
        """The projections a one-row step runs on layers/gemv.py's kernels (q/k/v and gate/up with their norm folded
        in, q/k/v with rotary and the K/V store after it too, o and down where bias-free, the LM head always): a layer
        with Gemma's (1 + w) norm or a biased projection keeps the plain one."""
        layers, spec = self.model.layers, self.spec
        return [name for name, folded in (("q/k/v", all(layer.fold_qkv for layer in layers)),
                                          ("rotary and the K/V store (q/k/v's epilogue)",
                                           all(layer.fold_rope for layer in layers)),
                                          ("gate/up", all(layer.fold_mlp for layer in layers)),
                                          ("o", not spec.o_bias), ("down", not spec.mlp_bias),
                                          ("LM head", True)) if folded]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[N, V] logits, in float32 unless `float32` is False (the model dtype: prompt logprobs score every
        prompt row, and reduce them in float32 without a [rows, vocab] float32 copy)."""
        head = self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head
        if head_rows(hidden):  # float32 from the kernel where nothing follows in the model dtype
            rows = gemv(hidden, head.weight, float32 and self.spec.final_softcap is None)
        else:
            rows = nn.functional.linear(hidden, head.weight)
        logits = gather_vocab(rows, head)  # [N, V] on every rank
        if self.spec.final_softcap is not None:  # in the model dtype, as transformers does
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope dict (transformers 5's rope_parameters, or 4.x's rope_theta + rope_scaling)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params[layer_type] if layer_type is not None else params)
    rope = dict(getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = config.rope_theta
    return rope


def base_spec(config, **overrides) -> DecoderSpec:
    """The fields every family reads the same way; `overrides` sets the family's own."""
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps, activation=getattr(config, "hidden_act", "silu"),
        layer_types=[FULL] * n, rope={FULL: rope_parameters(config)},
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
    fields.update(overrides)
    return DecoderSpec(**fields)


def config_layer_types(config, default_rule) -> list[str]:
    """config.layer_types when the config has it (transformers 5 always fills it), else the family's rule."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [default_rule(i) for i in range(config.num_hidden_layers)]
    types = list(types)[: config.num_hidden_layers]
    if len(types) != config.num_hidden_layers or not set(types) <= {FULL, SLIDING}:
        raise ValueError(f"layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                         f"{config.num_hidden_layers} layers, got {types}")
    return types
