"""Backend selection: the argument, then FLEXENGINE_ATTENTION_BACKEND, then auto."""
from __future__ import annotations

import functools

from ...config import BACKEND_ENV, BACKEND_NAMES, env_attention_backend
from .flex import FlexBackend
from .reference import ReferenceBackend


def resolve_backend_name(name: str | None) -> tuple[str, str]:
    """(backend name, where the choice came from). Raises ValueError on an unknown name."""
    source = "argument"
    if name is None:
        name, source = env_attention_backend(), BACKEND_ENV
    if name is None:
        name, source = "auto", "default"
    name = name.strip().lower() if isinstance(name, str) else name
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r} (from {source}); valid: {', '.join(BACKEND_NAMES)}")
    return name, source


def get_backend(name: str | None = None, mods=(), head_dim: int | None = None, block_size: int | None = None,
                dtype=None, graphs: bool = False, shared: bool = True):
    """A backend instance for `name` (None → env → auto) that can serve every (mask, score) in mods.

    block_size and dtype (optional) let flash refuse early: FA2's paged KV needs block_size % 256 == 0,
    and the kernels take only float16/bfloat16. `graphs`: the engine replays decode from CUDA graphs,
    which only flex does here, so auto keeps flex (measured faster end to end, docs/benchmarks.md).
    `shared=False` (an engine): a flex instance of its own, since it holds the engine's prefill
    workspace, sized for that engine's model and dtype; the functional API shares one.
    """
    from .flash import Unsupported, flash_unsupported_reason, make_flash_backend, note_auto_fallback

    chosen, source = resolve_backend_name(name)
    if chosen == "reference":
        return ReferenceBackend()
    flex = default_flex if shared else FlexBackend
    if chosen == "flex":
        return flex()
    reason = flash_unsupported_reason(mods, head_dim, block_size, dtype)
    if chosen == "flash":
        if reason:
            raise ValueError(f"attention backend 'flash' (from {source}) cannot serve this model: {reason}")
        return make_flash_backend(block_size)
    if not reason and graphs:
        reason = Unsupported("graphs", "flex replays the decode steps from CUDA graphs and flash cannot; on an H100 "
                                       "flash was 2.6x slower in throughput and 5.9x at batch 1 "
                                       "(FLEXENGINE_ATTENTION_BACKEND=flash forces it)")
    if reason:  # auto
        note_auto_fallback(reason)
        return flex()
    return make_flash_backend(block_size)


@functools.cache
def default_flex() -> FlexBackend:
    """One shared instance, so each mod is checked once per process, not once per call."""
    return FlexBackend()
