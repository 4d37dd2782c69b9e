"""Which slice of each checkpoint tensor this rank reads: the loader's layout, with the full checkpoint
shape and a `source` index for every tensor a sharded layer holds part of. The loader then reads only
that slice (safetensors' get_slice), so no rank ever holds a whole sharded tensor."""
from __future__ import annotations

import dataclasses

from ..layers.linear import MergedLinear


def shard_layout(model, layout: dict) -> dict:
    """layout: checkpoint name → loader.TensorTarget (whole tensors); → the same for this rank's slices.
    Unchanged for a model built at TP=1 (its layers report no sources)."""
    for name, module in model.named_modules():
        sources = getattr(module, "checkpoint_sources", None)
        if sources is None:
            continue
        # A fused module's checkpoint tensors are its parent's (…self_attn.q_proj.weight), a plain one's its own.
        prefix = name.rpartition(".")[0] if isinstance(module, MergedLinear) else name
        for leaf, (full_shape, source) in sources().items():
            key = f"{prefix}.{leaf}" if prefix else leaf
            if key not in layout:  # a tied lm_head has no tensor of its own
                continue
            target = layout[key]
            rows = target.rows
            if hasattr(module, "num_real") and module.num_real != module.weight.shape[0]:
                rows = slice(0, module.num_real)  # the vocabulary's last rank: padding rows past V
            layout[key] = dataclasses.replace(target, rows=rows, shape=tuple(full_shape), source=source)
    return layout
