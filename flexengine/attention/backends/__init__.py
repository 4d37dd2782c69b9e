"""Backend selection: the argument, then FLEXENGINE_ATTENTION_BACKEND, then auto."""
from __future__ import annotations

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


def get_backend(name: str | None = None, mods=(), head_dim: int | None = None):
    """A backend instance for `name` (None → env → auto) that can serve every (mask, score) in mods."""
    from .flash import flash_unsupported_reason, make_flash_backend

    chosen, source = resolve_backend_name(name)
    if chosen == "reference":
        return ReferenceBackend()
    if chosen == "flex":
        return FlexBackend()
    reason = flash_unsupported_reason(mods, head_dim)
    if chosen == "flash":
        if reason:
            raise ValueError(f"attention backend 'flash' (from {source}) cannot serve this model: {reason}")
        return make_flash_backend()
    return FlexBackend() if reason else make_flash_backend()  # auto
