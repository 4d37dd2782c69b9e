"""Engine configuration. Environment overrides are read here and nowhere else."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

BACKEND_ENV = "FLEXENGINE_ATTENTION_BACKEND"
BACKEND_NAMES = ("flex", "flash", "reference", "auto")


def env_attention_backend() -> str | None:
    """The backend named by FLEXENGINE_ATTENTION_BACKEND, or None when unset or empty."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    return value or None


def resolve_device(device):
    """EngineConfig.device → a torch.device: "auto" (or None) is CUDA where available, else the CPU."""
    import torch  # here: the API process imports this module without loading torch
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return dev


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name`, one of `choices` (case-insensitive); unset or empty: the first."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


FLEX_PREFILL_ENV = "FLEXENGINE_FLEX_PREFILL"
FLEX_PREFILL_KERNELS = ("auto", "triton", "flash")


def env_flex_prefill_kernel() -> str:
    """The kernel of flex's compiled prefill call: auto (FlashAttention-4 where installed, else Triton),
    triton or flash, from FLEXENGINE_FLEX_PREFILL (attention/backends/prefill_kernel.py)."""
    return _env_choice(FLEX_PREFILL_ENV, FLEX_PREFILL_KERNELS)


DIST_BACKEND_ENV = "FLEXENGINE_DIST_BACKEND"
DIST_BACKENDS = ("auto", "nccl", "gloo")


def env_dist_backend() -> str:
    """The torch.distributed backend of tensor parallelism: auto (NCCL on CUDA, gloo on the CPU), nccl or
    gloo, from FLEXENGINE_DIST_BACKEND."""
    return _env_choice(DIST_BACKEND_ENV, DIST_BACKENDS)


ALL_REDUCE_ENV = "FLEXENGINE_ALL_REDUCE"
ALL_REDUCES = ("auto", "nccl", "one_shot", "torch_one_shot")


def env_all_reduce() -> str:
    """How tensor parallelism sums the layers' partial outputs, from FLEXENGINE_ALL_REDUCE: auto (the default:
    one_shot where every pair of the group's GPUs has peer access, else NCCL), nccl, or one_shot (CUDA only:
    each rank reads the others' copy through symmetric memory in one kernel, for inputs up to
    one_shot.TORCH_OP_MAX_BYTES: flexengine's kernel for decode's small sums, torch's op for the rest;
    torch_one_shot: torch's op for all of them, as before session 26). docs/parallelism.md has the measurements."""
    return _env_choice(ALL_REDUCE_ENV, ALL_REDUCES)


DECODE_SPLITS_ENV = "FLEXENGINE_DECODE_SPLITS"
SPLIT_KV_ENV = "FLEXENGINE_SPLIT_KV"
SPLIT_KV_MODES = ("auto", "kernel", "rows")


def env_decode_splits() -> int | None:
    """The most split-KV rows a decode request gets on CUDA, from FLEXENGINE_DECODE_SPLITS (a positive
    integer; unset: the engine's choice, attention/layout.choose_decode_splits). 1 turns split-KV off: no
    query gather and no merge launch per layer, one program per KV head. A probe's knob (issue 16)."""
    value = os.environ.get(DECODE_SPLITS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DECODE_SPLITS_ENV} must be a positive integer, got {value!r}")
    return int(value)


def env_split_kv() -> str:
    """Where a decode request's pages are split on CUDA, from FLEXENGINE_SPLIT_KV: kernel (flex's own SPLIT_KV
    programs over one row, which reads its query and writes its output in place, but evaluates the mask on every
    page), rows (a flex row per split over full and partial pages, with a query gather before and a log-sum-exp
    merge after), or auto (the default: kernel for a step's lone decode request, rows for more). H100, session 19:
    batch 1 decodes at 1.500 ms/token split in the kernel against 1.595 in rows; 8 x 8192 attends in 140 µs
    against 122 µs (0.79x against 0.90x SDPA-flash)."""
    return _env_choice(SPLIT_KV_ENV, SPLIT_KV_MODES)


ONE_ROW_GEMV_ENV, ONE_ROW_GEMV_MODES = "FLEXENGINE_ONE_ROW_GEMV", ("on", "off")


def env_one_row_gemv() -> bool:
    """FLEXENGINE_ONE_ROW_GEMV: on (the default) runs a one-row step's projections (q/k/v, gate/up, o, down, the LM
    head) on layers/gemv.py's kernels on CUDA, the norms and SiLU folded into q/k/v and gate/up (on the H100, 1.417 →
    1.372 ms a step in session 23; with o and down under PDL, 1.300 → 1.230 in session 24, docs/benchmarks.md); off
    keeps cuBLAS and the separate kernels."""
    return _env_choice(ONE_ROW_GEMV_ENV, ONE_ROW_GEMV_MODES) == "on"


PDL_ENV, PDL_MODES = "FLEXENGINE_PDL", ("on", "off")


def env_pdl() -> bool:
    """FLEXENGINE_PDL: on (the default) launches the engine's Triton kernels (Inductor's, through its
    `triton.enable_pdl`, and layers/gemv.py's) with programmatic dependent launch on Hopper and later: a kernel
    starts while the one before it drains and waits on the device (griddepcontrol) for that one's writes, instead of
    after a launch gap. On the H100 it took 0.09-0.10 ms off every small-batch step (batch 1 1.391 → 1.299 ms, batch
    32 1.802 → 1.701; docs/benchmarks.md session 24). Below sm90 neither Inductor nor the GEMV uses it; flex's
    attention templates never do (Inductor gives templates no PDL). off: plain launches."""
    return _env_choice(PDL_ENV, PDL_MODES) == "on"


COMBO_KERNELS_ENV = "FLEXENGINE_COMBO_KERNELS"


def env_combo_kernels() -> bool:
    """Inductor's combo kernels in the batch-1 decode graph's compiled regions (compile.decode_regions) and the
    step helpers: data-independent kernels of one region (the queries' rotary and the two cache writes) launched
    as one. On unless FLEXENGINE_COMBO_KERNELS=0. A batch-1 step is mostly small kernels: on the H100 they took
    the 1B step from 269 to 232 kernels and 1.500 to 1.441 ms/token (docs/benchmarks.md, session 19)."""
    value = os.environ.get(COMBO_KERNELS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{COMBO_KERNELS_ENV} must be 0 or 1, got {value!r}")
    return value != "0"


def fa4_disk_cache_default() -> None:
    """FA4 compiles each kernel it is asked for through CuTe DSL (~16 s each on the H100, session 31) and keeps the
    result on disk only when FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 at its import: a second start on one machine
    then loads it. On unless the user set it, in cache_dir()/fa4 unless the user named a folder (FA4's own default,
    the temp folder, is emptied by a reboot); called before anything imports flash_attn.cute."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", os.path.join(cache_dir(), "fa4"))


def compile_cache_defaults() -> None:
    """Keep a GPU engine's compiled kernels where the machine's next start finds them, as vLLM keeps its own under
    ~/.cache/vllm: Inductor's cache (and the Triton cache inside it) in cache_dir()/inductor unless
    TORCHINDUCTOR_CACHE_DIR names another folder (Inductor's default is the temp folder, which a reboot empties),
    FA4's as fa4_disk_cache_default. A first start compiles everything (~145 s at the 1B model's 131,072 context on
    the H100), a start that finds the caches 43-54 s (session 31). Called before the engine compiles anything."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    fa4_disk_cache_default()
    # importing torch._dynamo writes Inductor's default (the temp folder) into the variable: that value is torch's
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), "inductor")


def env_api_key() -> str | None:
    """The server's bearer token from FLEXENGINE_API_KEY (used when --api-key is not given)."""
    return os.environ.get("FLEXENGINE_API_KEY") or None


def env_stats_interval_s() -> float:
    """Seconds between the server engine's stats lines: FLEXENGINE_STATS_INTERVAL_S, else vLLM's 5."""
    return float(os.environ.get("FLEXENGINE_STATS_INTERVAL_S") or 5.0)


def cache_dir() -> str:
    """Where flexengine keeps built artefacts (the embedded default model): FLEXENGINE_CACHE_DIR,
    else $XDG_CACHE_HOME/flexengine, else ~/.cache/flexengine."""
    explicit = os.environ.get("FLEXENGINE_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexengine")


DEFAULT_BLOCK_SIZE = 16
GPU_FLEX_BLOCK_SIZE = 128


def default_block_size(device_type: str, attention_backend: str | None) -> int:
    """Tokens per KV page when none is asked for: 128 where compiled flex serves (a GPU, backend flex or
    auto), else 16 (the CPU, and the flash and reference backends, as before).

    Flex's decode kernel reads one page per KV tile, so 16-token pages cap its tile at 16 keys. On the H100
    128-token pages ran decode 8 x 8192 at 0.90x SDPA-flash against 0.45x, 64 x 2048 at 1.08x against
    0.79x, and 16 prompts x 6144 in x 256 out end to end in 1.71 s against 2.78 s (docs/benchmarks.md,
    sessions 12-13). The cost is coarser prefix-cache hits (whole 128-token pages) and up to 127 unused
    slots per request."""
    if device_type != "cuda":
        return DEFAULT_BLOCK_SIZE
    name = attention_backend if attention_backend is not None else env_attention_backend()
    name = (name or "auto").strip().lower()
    return GPU_FLEX_BLOCK_SIZE if name in ("auto", "flex") else DEFAULT_BLOCK_SIZE


def default_max_num_batched_tokens(device_type: str) -> int:
    """The token budget of one step when none is asked for: 8192 on a GPU, 2048 on the CPU.

    vLLM's defaults (EngineArgs.get_batch_defaults): 8192 for `LLM` on GPUs under 70 GiB and for its server on
    larger ones (16384 for `LLM` there), 2048 for its server on smaller GPUs. On the H100 a 65,536-token prompt
    prefilled in 0.88 s at 8192 against 1.14 s at 2048 (fewer steps, each chunk's prefix read fewer times;
    docs/benchmarks.md, session 11). On the CPU a step's time grows with its tokens, and decodes wait for it."""
    return 8192 if device_type == "cuda" else 2048


# Without a GPU to profile there is no memory to measure: the KV cache gets this many bytes (enough for
# SmolLM2-135M's whole 8,192-token context in float32, 377 MB; 256 MiB had capped it at 5,824, with a warning
# on every run of the README's first command).
CPU_KV_CACHE_BYTES = 512 << 20
# On CPU, FlexAttention runs eagerly and materialises scores over the whole page pool, so the pool is
# also capped in tokens (a larger pool costs time on every step, not only memory).
CPU_MAX_KV_TOKENS = 8192
# One layer's K (or V) pool is indexed with int32 inside the FlexAttention kernels: a pool of more
# elements than this fails to compile, so a measured cache is capped here (it only binds for tiny models).
MAX_KV_POOL_ELEMENTS = 2 ** 31 - 1
# Unasked, max_model_len is the model's max_position_embeddings; this where its config names none.
DEFAULT_MAX_MODEL_LEN = 8192
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineConfig:
    """Everything LLM(...) / LLMEngine(...) accept; validated on construction."""
    model: str | None = None              # path or hub id; None → the embedded default model
    dtype: str = "auto"
    device: str = "auto"                  # "auto" → cuda when available, else cpu
    block_size: int | None = None         # tokens per KV page; None → default_block_size(the device, backend)
    num_kv_blocks: int | None = None      # None → sized from memory (GPU profile / CPU_KV_CACHE_BYTES)
    gpu_memory_utilization: float = 0.9
    # None → the model's max_position_embeddings, or what the KV cache holds when that is less (logged);
    # an explicit value the cache cannot hold is a ValueError naming the blocks needed.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None → default_max_num_batched_tokens(the device)
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None → FLEXENGINE_ATTENTION_BACKEND → auto
    enforce_eager: bool = False
    # Ranks the model is sharded over (Megatron-style, one process each; flexengine/parallel/).
    tensor_parallel_size: int = 1
    # Pure decode steps run this many forward passes per schedule, each fed the last one's tokens on
    # the device, with one host sync at the end (vLLM's multi-step scheduling); CUDA graphs only.
    num_scheduler_steps: int = 1
    # Launch each step before reading the last one's tokens back, so that detokenizing, stop checks and
    # streaming overlap the device (vLLM's async scheduling). A sequence that stops runs one step more,
    # whose token is dropped. None (the default, as vLLM's since 0.14, offline and served alike): on for a
    # GPU unless num_scheduler_steps > 1, off on CPU, where the host and the device are the same cores.
    async_scheduling: bool | None = None
    seed: int = 0
    # Overrides of the model's mods: a registered name, a callable, or {layer index or kind ("global" /
    # "sliding"): either}; None keeps the model's. Applied (and checked) by ModelRunner.
    mask_mod: Any = None
    score_mod: Any = None

    def __post_init__(self):
        def positive(name, allow_none=False):
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "num_scheduler_steps", "tensor_parallel_size"):
            positive(name)
        positive("block_size", allow_none=True)
        positive("max_num_batched_tokens", allow_none=True)
        positive("num_kv_blocks", allow_none=True)
        positive("max_model_len", allow_none=True)
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in DTYPES and not _is_torch_dtype(self.dtype):
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a string such as 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend is not None and str(self.attention_backend).strip().lower() not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)} or None, "
                             f"got {self.attention_backend!r}")
        if self.async_scheduling not in (True, False, None):
            raise ValueError(f"async_scheduling must be True, False or None (on for a GPU), got {self.async_scheduling!r}")
        if self.async_scheduling and self.num_scheduler_steps > 1:
            raise ValueError(f"async_scheduling and num_scheduler_steps={self.num_scheduler_steps} exclude each "
                             f"other: choose one way to keep the device busy")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def _is_torch_dtype(value) -> bool:
    import torch
    return isinstance(value, torch.dtype)
