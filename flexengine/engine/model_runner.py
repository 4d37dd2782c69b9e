"""The model, its paged KV cache and one step: pack the inputs, run the model, sample.

A step is three functions named for what they do:
  prepare_step(batch) -> StepInputs    host lists → device tensors (one transfer each) + metadata (once)
                                       (pack_step is its host half: pack_lengths, then plan_step; a mixed CUDA
                                       graph takes pack_lengths' arrays and plans the rest on the device)
  run_model(input_ids, positions, meta) -> hidden   the only call the compile layer needs to wrap
  sample(forwarded, sampling_inputs(forwarded, prev)) -> tokens   logits only for rows that need a token
`execute` is the three in a row; the engine calls `forward` and `sample` apart when a grammar's masks need
the step before's tokens (LLMEngine._grammar_step). A pure decode step runs from the decode CUDA graphs instead
(decode_steps.py).
"""
from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..attention.backends import get_backend
from ..attention.kv_cache import allocate_kv_cache
from ..attention.metadata import AttentionMetadata, build_metadata
from ..attention.layout import (Q_TILE, choose_decode_splits, segment_capacity, split_rows_or_programs,
                                workspace_tokens)
from ..attention.staging import to_device
from ..compile import (bucket, decode_buckets, fused_elementwise, mixed_decode_buckets, start_compile_workers,
                       tile_bucket, unoptimised_launcher_builds, wide_q_tiles)
from ..compile import mixed_graphs
from ..compile.mixed_graphs import MixedKey, graph_workspace_pages
from ..compile.warmup import max_prefill_tiles
from ..config import EngineConfig, compile_cache_defaults, resolve_device
from ..layers import gemv as one_row_gemv
from ..layers.sampler import Sampler, SamplerOutput, SamplingTensors
from .kv_sizing import (bytes_per_block, choose_max_model_len, measure_num_blocks, text_config, wanted_max_model_len,
                        workspace_tokens_wanted)
from .layer_mods import apply_mod_overrides, mod_params
from .prompt_logprobs import PromptLogprobs, score_prompt_tokens
from .decode_inputs import DecodeTracker
from .decode_steps import DecodeGraphSteps
from .step_inputs import PackedStep, pack_lengths, plan_step
from .sampling_inputs import SamplingInputs
from .in_flight import InFlightStep, feed_inputs
from ..parallel import agree_on_min, building_for, drive_workers, shift_layer_mods, start_tensor_parallel
from ..parallel.collectives import choose_all_reduce
from .scheduler import ScheduledBatch
from .sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor           # int64 [T]
    positions: torch.Tensor           # int64 [T]
    meta: AttentionMetadata
    sample_seqs: list[Sequence]       # sequences that get a token this step, in row order
    sample_rows: torch.Tensor         # int64 [N]: their last token's row in the packed batch


def wants_compile(device: torch.device, enforce_eager: bool) -> bool:
    """Compiled kernels and CUDA graphs: on CUDA unless enforce_eager (CPU Inductor builds are slow)."""
    return device.type == "cuda" and not enforce_eager


NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}  # the dtypes a mod's parameter can declare


@dataclass
class Forwarded:
    """A step whose forward is queued and whose sampler is not yet."""
    seqs: list[Sequence]          # the sequences that sample a token, in row order
    logits: torch.Tensor | None   # their logits (None when no row samples)
    prompt: PromptLogprobs | None  # the prompt logprobs of the sequences that ask


class ModelRunner(DecodeGraphSteps):
    def __init__(self, config: EngineConfig):
        from ..models.loader import load_model  # the model side; imported here so the engine imports stay light

        self.config = config
        if config.model is None:
            from ..models.default_model import default_model_path
            self.model_path = default_model_path()
        else:
            self.model_path = os.fspath(config.model)
        # Tensor parallelism (parallel/): checks, spawns the workers, joins their group; at TP=1 nothing.
        self.tp, self.workers = start_tensor_parallel(config, self.model_path)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            compile_cache_defaults()  # before anything compiles: a reboot must not empty the caches
        if wants_compile(self.device, config.enforce_eager):
            start_compile_workers()  # they start while the weights load
            if self.device.type == "cuda":
                unoptimised_launcher_builds()
        began = started = time.perf_counter()
        with building_for(self.tp):  # this rank's shard of every layer, read from its slices of the checkpoint
            self.model, self.hf_config, self.tokenizer = load_model(self.model_path, config.dtype, self.device)
        logger.info("model loaded in %.1f s", time.perf_counter() - started)
        self.layers = self.model.attention_layers()
        # Before the backend is chosen; checked on positions up to the longest max_model_len can become.
        apply_mod_overrides(self.layers, config.mask_mod, config.score_mod,
                            max_len=wanted_max_model_len(config, self.hf_config), num_reqs=config.max_num_seqs,
                            device=self.device)
        shift_layer_mods(self.layers)  # under TP, a mod sees global head indices
        first = self.layers[0]
        assert all((a.num_kv_heads, a.head_dim) == (first.num_kv_heads, first.head_dim) for a in self.layers), \
            "one KV cache shape for every layer"
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        self.dtype = next(self.model.parameters()).dtype
        if one_row_gemv.serves(self.device, self.dtype):
            logger.info("batch-1 steps run %s on one-row GEMVs (q/k/v and gate/up with their norm folded in; "
                        "FLEXENGINE_ONE_ROW_GEMV=off: cuBLAS)", ", ".join(self.model.one_row_projections()))
        choose_all_reduce(self.tp, self.dtype, self.device)  # one-shot or NCCL (FLEXENGINE_ALL_REDUCE)
        self.vocab_size = text_config(self.hf_config).vocab_size
        self.sampling = SamplingInputs(self.device, self.vocab_size, self.config.max_num_seqs)
        self.block_size = config.block_size
        self.decode_buckets = decode_buckets(config.max_num_seqs)  # the decode steps' padded batch sizes
        self.mixed_decode_buckets = mixed_decode_buckets(config.max_num_seqs)  # (decode rows beside prompt tokens)
        self.mods = [(a.mask_mod, a.score_mod) for a in self.layers]
        self.mod_params = mod_params(self.mods)  # {name: its dtype, fixed here, and the mod reading it}
        self.compiled = wants_compile(self.device, config.enforce_eager)  # fused kernels and CUDA graphs
        self.backend = get_backend(config.attention_backend, self.mods, self.head_dim, block_size=config.block_size,
                                   dtype=self.dtype, graphs=self.compiled, shared=False)
        # Flex on a GPU is always the compiled kernel (eager flex materialises every score), even with
        # enforce_eager, and compiled flex needs a fixed set of shapes: decode rows and prefill tiles
        # padded to buckets, every per-request tensor max_num_seqs rows long.
        self.static_shapes = self.backend.name == "flex" and self.backend.compiled(self.device)
        # Compiled flex prefills from a workspace of fixed size (attention/metadata.py), made before the
        # KV cache is sized; the scheduler keeps each step's prefill contexts within it.
        self.workspace_tokens = None
        # The largest prefill bucket: its steps over long contexts may take wide q blocks (compile.wide_q_tiles),
        # unless a whole mixed CUDA graph (keyed without them) serves it
        top = max_prefill_tiles(config.max_num_batched_tokens)
        self.whole_graph_tiles = mixed_graphs.MAX_GRAPH_TILES  # (read here: tests lower it)
        self.max_prefill_tiles = top if top > self.whole_graph_tiles else 0
        if self.static_shapes:
            pages = -(-workspace_tokens_wanted(config, self.hf_config) // self.block_size)
            self.backend.reserve_workspace(pages, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                                           self.device)
            self.workspace_tokens = self.backend.workspace_pages * self.block_size
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.generator, self.compiled)

        started = time.perf_counter()
        self.num_blocks = config.num_kv_blocks or agree_on_min(measure_num_blocks(self), self.tp)
        logger.info("KV cache sized in %.1f s (a profiling step of the largest batch)", time.perf_counter() - started)
        self.max_model_len = choose_max_model_len(config, self.hf_config, self.num_blocks)
        # One page past the block manager's: padded rows of a captured batch write their K/V there.
        self.kv_cache = allocate_kv_cache(len(self.layers), self.num_blocks + 1, self.block_size, self.num_kv_heads,
                                          self.head_dim, self.dtype, self.device)
        self.attach_kv_cache(self.kv_cache)
        # A fixed table width keeps every compiled shape (and stride) the same from step to step.
        self.table_width = -(-self.max_model_len // self.block_size)
        self.decode_graphs = self.mixed_graphs = None
        self.decode_tracker = DecodeTracker()
        if self.compiled or self.static_shapes:
            from ..compile.warmup import compile_steps
            compile_steps(self)  # every step shape compiled (and captured) before the first request
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s; max_model_len %d", self.num_blocks,
                    self.block_size, self.num_blocks * bytes_per_block(self) / 2 ** 20, self.device,
                    self.max_model_len)
        if self.compiled:  # (as vLLM logs its engine's start-up)
            logger.info("engine ready in %.1f s: load, KV sizing, compiles, graph capture (a machine's first start "
                        "compiles every kernel; later ones read most from the compile caches)",
                        time.perf_counter() - began)
        if self.workers is not None:  # rank 0: from here on, each step is announced to the workers
            drive_workers(self, self.workers)

    def attach_kv_cache(self, cache: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = (None, None) if cache is None else cache[i]

    # ---------------------------------------------------------------- the step
    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def pack_lengths(self, batch: ScheduledBatch) -> PackedStep:
        """The scheduled tokens' ids, the requests' lengths and block tables, and which rows sample (step_inputs.py);
        with static shapes every per-request array has max_num_seqs rows, so the request count never changes a
        compiled shape."""
        return pack_lengths(batch, self.config.max_num_seqs if self.static_shapes else 0)

    def step_padding(self, p: PackedStep) -> dict:
        """layout_padding of pack_lengths' step `p`."""
        return self.layout_padding(p.query_lens, p.seq_lens[: len(p.query_lens)].astype(np.int64))

    def plan_step(self, p: PackedStep, padding: dict | None = None) -> PackedStep:
        """pack_lengths' step with its positions, slots and layout planned on the host; with static shapes, padded
        to whole prefill tiles (compiled flex reads the token buffer as tiles; the eager path reads T rows).
        padding: step_padding(p), when the caller has it."""
        scratch_page = self.layers[0].k_cache.shape[0] - 1  # (the attached cache: a scratch one while profiling)
        return plan_step(p, self.block_size, self.step_padding(p) if padding is None else padding,
                         scratch_page * self.block_size if self.static_shapes else None)

    def pack_step(self, batch: ScheduledBatch) -> PackedStep:
        """The scheduled tokens as host arrays: ids, positions, slots, block tables, lengths, layout."""
        return self.plan_step(self.pack_lengths(batch))

    def graph_key(self, p: PackedStep, pad: dict | None = None) -> MixedKey | None:
        """The mixed CUDA graph that runs pack_lengths' step `p` (its layout planned on the device), or None.
        pad: step_padding(p), when the caller has it."""
        pad = self.step_padding(p) if pad is None else pad
        rows, kernel_splits = split_rows_or_programs(pad["decode_splits"], pad["pad_decode_to"])
        key = MixedKey(pad["pad_decode_to"], rows, pad["pad_tiles_to"], pad["pad_segments_to"],
                       pad["pad_workspace_to"], kernel_splits, pad["q_tiles"])
        return key if self.mixed_graphs.fits(key) else None

    def run_mixed_graph(self, p: PackedStep, key: MixedKey, seqs: list[Sequence], feed=None) -> torch.Tensor:
        """The hidden states of pack_lengths' step `p` from the mixed graph of `key` (graph_key)."""
        return self.mixed_graphs.run(p.ids, p.query_lens, p.seq_lens, p.tables, key,
                                     self.attention_params(seqs, len(p.seq_lens)), feed=feed)

    def prepare_step(self, batch: ScheduledBatch, packed: PackedStep | None = None) -> StepInputs:
        """pack_step (unless given), then the device half: one transfer per array, the metadata built once."""
        p = packed or self.pack_step(batch)
        num_blocks = self.layers[0].k_cache.shape[0]  # the attached cache (a scratch one while profiling)
        tables = self.to_device(p.tables)
        width = getattr(self, "table_width", 0)  # unset while profiling
        if self.static_shapes and tables.shape[1] < width:  # one compiled shape whatever the step's tables
            tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
        meta = build_metadata(tables, self.to_device(p.seq_lens), self.to_device(p.slots),
                              p.layout, self.block_size, num_blocks, self.attention_params(batch.seqs, len(p.seq_lens)))
        meta.backend = self.backend
        self.backend.prepare(meta, self.mods)
        return StepInputs(
            input_ids=self.to_device(p.ids), positions=self.to_device(p.positions), meta=meta,
            sample_seqs=p.sample_seqs, sample_rows=self.to_device(p.sample_rows))

    def layout_padding(self, query_lens: np.ndarray, seq_lens: np.ndarray) -> dict:
        """With static shapes, pad decode rows and prefill tiles to the compiled buckets (the split-KV
        count the decode graphs use), so no step meets a shape the warm-up did not compile."""
        if not self.static_shapes:
            return {}
        num_decode = int((query_lens == 1).sum())
        tiles = tile_bucket(-(-int(query_lens.sum()) // Q_TILE)) if num_decode < len(query_lens) else 0
        buckets = self.mixed_decode_buckets if tiles else self.decode_buckets
        rows = bucket(num_decode, buckets) if num_decode else 0
        wide = wide_q_tiles(getattr(self.backend, "q_tiles", 1), query_lens, seq_lens, tiles, self.max_prefill_tiles)
        return dict(pad_decode_to=rows, pad_tiles_to=tiles, q_tiles=wide,
                    pad_segments_to=segment_capacity(tiles, self.config.max_num_seqs),
                    decode_splits=choose_decode_splits(rows, self.num_kv_heads, self.device),
                    block_size=self.block_size, pad_workspace_to=self.workspace_bucket(query_lens, seq_lens, tiles))

    def workspace_bucket(self, query_lens: np.ndarray, seq_lens: np.ndarray, tiles: int) -> int:
        """Workspace pages a step of `tiles` (padded) prefill tiles gathers: a mixed CUDA graph's fixed
        number when its contexts fit one (compile/mixed_graphs.py), else just what it needs. Prefill that reads
        the pages in place gathers nothing, so any step takes the graph's number."""
        need = workspace_tokens(query_lens, seq_lens, self.block_size)
        assert need <= self.workspace_tokens, (need, self.workspace_tokens)  # the scheduler's promise
        graph = graph_workspace_pages(tiles, self.block_size, self.backend.workspace_pages)
        fits = need <= graph * self.block_size or self.backend.direct(self.block_size, self.device)
        return graph if tiles > 0 and fits else 0

    def attention_params(self, seqs: list[Sequence], rows: int = 0) -> dict[str, torch.Tensor]:
        """Per-request mod parameters (SamplingParams.attention_params) as [max(R, rows)] tensors.

        Every parameter a layer's mod reads is present (absent → 0: warm-up, profiling and padding rows),
        in the dtype its mod declares, so every step (and the warm-up) meets the same compiled kernel.
        """
        if not self.mod_params:  # (most models: no per-request parameter, and no walk over the requests)
            return {}
        given = [(s.params.attention_params or {}) if s.params is not None else {} for s in seqs]
        pad = [0] * max(0, rows - len(seqs))
        return {name: self.to_device(np.asarray([g.get(name, 0) for g in given] + pad, dtype=NUMPY_DTYPES[p.dtype]))
                for name, p in sorted(self.mod_params.items())}

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with fused_elementwise(self.compiled):  # this engine's setting, whatever other engines use
            return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def sampling_inputs(self, fwd: Forwarded, prev: InFlightStep | None) -> SamplingTensors | None:
        """The sampled rows' parameters, masks and penalties on the device (prev: the step in flight, whose
        samples are PENDING tokens of these rows)."""
        return self.sampling.tensors(fwd.seqs, prev) if fwd.seqs else None

    @torch.inference_mode()
    def sample(self, fwd: Forwarded, tensors: SamplingTensors | None) \
            -> tuple[list[Sequence], SamplerOutput | None, PromptLogprobs | None]:
        """Queue the sampler: → (sequences that got a token, their sampler output, prompt logprobs)."""
        if not fwd.seqs:
            return [], None, fwd.prompt
        return fwd.seqs, self.sampler(fwd.logits, tensors), fwd.prompt

    # ---------------------------------------------------------------- what the CUDA graphs use
    def forward_logits(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model.compute_logits(self.run_model(input_ids, positions, meta))

    def release_graphs(self) -> None:
        """Drop the CUDA graphs: one that captured NCCL calls holds its communicator, and the tensor-parallel
        group cannot be left while any does (parallel/state.py)."""
        self.decode_graphs = self.mixed_graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def param_dtypes(self) -> dict[str, torch.dtype]:
        """{per-request parameter: its dtype}, sorted by name: what a CUDA graph's static buffers hold."""
        return {name: p.dtype for name, p in sorted(self.mod_params.items())}

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, prev: InFlightStep | None = None) \
            -> tuple[list[Sequence], SamplerOutput | None, PromptLogprobs | None]:
        """One step: → (sequences that got a token, their sampler output, the prompt logprobs of the
        sequences that ask), all still on the device.

        prev: the step launched before this one, whose samples are this step's PENDING input tokens."""
        fwd = self.forward(batch, prev)
        return self.sample(fwd, self.sampling_inputs(fwd, prev))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, prev: InFlightStep | None = None) -> Forwarded:
        """Queue the step's forward and the logits of the rows that sample (prompt logprobs too)."""
        if self.decode_with_graphs(batch):  # every row is a sequence's last token: no prompt token to score
            return Forwarded(batch.seqs, self.decode_from_graphs(batch.seqs, prev, batch.block_tables), None)
        self.decode_tracker.forget()  # (the graphs' buffers stay as they are, but the batch moves on without them)
        p = self.pack_lengths(batch)
        pad = self.step_padding(p)  # (once: the graph's key, or else the host plan)
        key = self.graph_key(p, pad) if self.mixed_graphs is not None else None
        if key is not None:  # a step with prompt tokens, from a graph
            hidden = self.run_mixed_graph(p, key, batch.seqs,
                                          feed=partial(feed_inputs, fed=self.feed(prev, batch.seqs, p.last_rows,
                                                                                  p.table_rows)))
        else:
            p = self.plan_step(p, pad)
            inputs = self.prepare_step(batch, packed=p)
            feed_inputs(inputs.input_ids, self.feed(prev, batch.seqs, p.last_rows, p.table_rows))
            hidden = self.run_model(inputs.input_ids, inputs.positions, inputs.meta)
        prompt = score_prompt_tokens(self.model.compute_logits, hidden, batch.seqs, batch.num_new_tokens,
                                     p.last_rows + 1 - np.asarray(batch.num_new_tokens), self.compiled)
        if not p.sample_seqs:
            return Forwarded([], None, prompt)
        return Forwarded(p.sample_seqs, self.model.compute_logits(hidden[self.to_device(p.sample_rows)]), prompt)

    def feed(self, prev: InFlightStep | None, seqs: list[Sequence], last_rows, rows=None):
        """The rows of this step whose input is a PENDING sample of `prev`, with its values (on the device); rows: the
        sequences' BlockTables rows, when known."""
        if prev is None:
            assert not any(s.num_pending for s in seqs), "a PENDING token with no step in flight"
            return None
        return prev.feed(seqs, last_rows, self.device, rows)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
