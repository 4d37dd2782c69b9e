"""Engine configuration. Environment overrides are read here and nowhere else."""
from __future__ import annotations

import os

BACKEND_ENV = "FLEXENGINE_ATTENTION_BACKEND"
BACKEND_NAMES = ("flex", "flash", "reference", "auto")


def env_attention_backend() -> str | None:
    """The backend named by FLEXENGINE_ATTENTION_BACKEND, or None when unset or empty."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    return value or None


def cache_dir() -> str:
    """Where flexengine keeps built artefacts (the embedded default model): FLEXENGINE_CACHE_DIR,
    else $XDG_CACHE_HOME/flexengine, else ~/.cache/flexengine."""
    explicit = os.environ.get("FLEXENGINE_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexengine")
