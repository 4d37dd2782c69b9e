"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out.

    engine = LLMEngine(EngineConfig(model=...))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...   # text and token_ids are cumulative, as vLLM's

Every input is validated in add_request before anything is allocated (engine/input_processor.py), so a bad
request raises ValueError and leaves the engine exactly as it was.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from ..attention.layout import Q_TILE, workspace_align
from ..config import EngineConfig, default_block_size, default_max_num_batched_tokens, resolve_device
from ..masks import MASK_ARGS, SCORE_ARGS, mod_name, request_params
from ..outputs import CompletionDelta, FlatLogprobs, RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer
from .block_manager import BlockManager
from .in_flight import InFlightStep
from .input_processor import InputProcessor
from .kv_sizing import text_config
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .prompt_logprobs import wants_prompt_logprobs
from .scheduler import Scheduler
from .sequence import PENDING, Request, Sequence
from .structured_outputs import Grammars, accept_tokens, finish_terminated

logger = logging.getLogger(__name__)


def prefix_cache_unsafe_reason(mods, masks_only: bool = False) -> str | None:
    """Why cached pages could be wrong to reuse with these (mask, score) mods, or None when they are safe.

    A cached page is reused by any request with the same leading tokens, so its K/V must depend on those
    tokens alone. A mask that lets a query see a later key breaks that in every layer after the first (a
    token's hidden state, hence its K/V, then depends on what follows), and so does a mod reading
    per-request parameters (the same tokens get other K/V under other values). Only masks marked
    `causal_safe` (causal, sliding_window, chunked_local, and_masks with one of them, or_masks of them)
    are trusted; a user's mask without the mark counts as unsafe.
    """
    for mask, score in mods:
        if not getattr(mask, "causal_safe", False):
            return f"mask {mod_name(mask)} is not known to be causal (no causal_safe = True)"
        if masks_only:
            continue
        for fn, base in ((mask, MASK_ARGS), (score, SCORE_ARGS)):
            if fn is not None and request_params(fn, base):
                return f"{mod_name(fn)} reads per-request parameters {', '.join(request_params(fn, base))}"
    return None


def resolve_async_scheduling(setting: bool | None, device_type: str, num_scheduler_steps: int) -> bool:
    """EngineConfig.async_scheduling: None turns it on where it pays, on a GPU, unless multi-step
    decode keeps the device busy instead (the two exclude each other)."""
    if setting is not None:
        return setting
    return device_type == "cuda" and num_scheduler_steps == 1


class LLMEngine:
    def __init__(self, config: EngineConfig):
        device_type = resolve_device(config.device).type
        if config.max_num_batched_tokens is None:
            config = dataclasses.replace(config, max_num_batched_tokens=default_max_num_batched_tokens(device_type))
        if config.block_size is None:
            config = dataclasses.replace(config, block_size=default_block_size(device_type, config.attention_backend))
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.look_ahead = prefix_cache_unsafe_reason(self.runner.mods, masks_only=True)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, self._use_prefix_cache())
        steps = config.num_scheduler_steps if self.runner.decode_graphs is not None else 1
        if steps != config.num_scheduler_steps:
            logger.info("num_scheduler_steps=%d needs CUDA graphs; running one step per schedule",
                        config.num_scheduler_steps)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   whole_prompts=self.look_ahead is not None, num_scheduler_steps=steps,
                                   max_model_len=self.max_model_len, chunk_align=Q_TILE,
                                   workspace_tokens=self.runner.workspace_tokens,
                                   workspace_align=workspace_align(config.block_size))
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, config.max_num_batched_tokens,
                                     self.look_ahead, self.block_manager, self.runner.mod_params)
        self.requests: dict[str, Request] = {}
        self.async_scheduling = resolve_async_scheduling(config.async_scheduling, self.runner.device.type, steps)
        self.in_flight: InFlightStep | None = None  # async scheduling: launched, not yet read back
        self.forwarded = None  # (batch, runner.Forwarded): a forward queued, its sampler not yet (_grammar_step)
        self.device_wait_s = 0.0  # time spent waiting for steps' tokens (the engine loop's stats)
        self.eos_token_ids = self._eos_token_ids()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)  # xgrammar loads on first use
        self.grammar_seqs: list[Sequence] = []  # live sequences with a grammar; empty: no per-step grammar work

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (they also stop when the engine is collected, or at exit)."""
        if self.runner.workers is not None:
            self.runner.workers.shutdown()

    def _use_prefix_cache(self) -> bool:
        """The prefix cache as asked for, unless the layers' mods would make shared pages wrong."""
        if not self.config.enable_prefix_caching:
            return False
        reason = prefix_cache_unsafe_reason(self.runner.mods)
        if reason:
            logger.info("prefix caching is off: %s", reason)
        return reason is None

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set()
        sources = [getattr(text_config(self.runner.hf_config), "eos_token_id", None)]
        if self.tokenizer is not None:
            sources.append(self.tokenizer.eos_token_id)
        gen_path = os.path.join(self.runner.model_path, "generation_config.json")
        if os.path.exists(gen_path):
            from transformers import GenerationConfig
            sources.append(GenerationConfig.from_pretrained(self.runner.model_path).eos_token_id)
        for source in sources:
            ids.update(source if isinstance(source, (list, tuple)) else [] if source is None else [source])
        return frozenset(int(i) for i in ids)

    # ---------------------------------------------------------------- accounting
    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def num_free_blocks(self) -> int:
        """Pages free or evictable (cached but unreferenced)."""
        return self.block_manager.num_free_blocks()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or self.forwarded is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------- requests in
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    final_only: bool = False, delta: bool = False) -> None:
        """Queue a request; raises ValueError (and changes nothing) when it is invalid.

        final_only: `step` reports the request once, when it finishes (vLLM's FINAL_ONLY output kind),
        and its text is decoded then, not token by token, unless stop strings need it.
        delta: each output's text, token_ids and logprobs are only what is new since the request's last
        output (vLLM's DELTA output kind), which saves copying everything so far at every step;
        prompt_token_ids is then the request's own list, not a copy.
        """
        assert not (final_only and delta), "final_only and delta exclude each other"
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, prompt_ids = self.inputs.tokenize(prompt)
        self.inputs.validate(prompt_ids, params)
        spec = params.structured_outputs
        grammar = None if spec is None else self.grammars.compile(spec)  # cached; ValueError naming the spec
        seqs = [self._make_sequence(request_id, i, prompt_ids, params.for_completion(i), grammar)
                for i in range(params.n)]
        prompt_array = np.array(prompt_ids, dtype=np.int64)  # (shared by the n completions, never written)
        for seq in seqs:
            seq.text_at_end = final_only and not params.stop
            seq.prompt_array = prompt_array
        self.requests[request_id] = Request(request_id, text, prompt_ids, params, seqs, final_only, delta)
        for seq in seqs:
            self.scheduler.add(seq)

    def compile_in_background(self, params: SamplingParams):
        """Start compiling the request's grammar on a worker thread: → a Future to wait for before
        add_request (which then finds it cached), or None when there is nothing to compile."""
        spec = params.structured_outputs if isinstance(params, SamplingParams) else None
        return None if spec is None else self.grammars.submit(spec)

    def _make_sequence(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                       grammar=None) -> Sequence:
        seq = Sequence(request_id=request_id, index=index, token_ids=list(prompt_ids),
                       num_prompt_tokens=len(prompt_ids), params=params)
        if grammar is not None:
            seq.grammar = self.grammars.matcher(grammar)
            self.grammar_seqs.append(seq)
        if params.seed is not None and not params.greedy:
            seq.generator = self.runner.make_generator(params.seed)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        if params.logprobs is not None:
            seq.logprobs = []
        if wants_prompt_logprobs(seq):
            seq.prompt_logprobs = FlatLogprobs(prompt_ids, params.prompt_logprobs, self.output_processor.decode_one)
        if params.min_tokens:
            seq.min_tokens_stops = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_token_ids)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Drop a request now; its pages are freed at once. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                self.scheduler.finish(seq, "abort")

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the outputs of the step it completes.

        Without async scheduling that is the step just launched. With it, the step launched by the
        previous call: its tokens are read back and processed while the new one runs on the device.
        """
        return self.output_processor.outputs(self.requests, self._step())

    def step_deltas(self) -> list[CompletionDelta]:
        """step() for streamed requests (all added with delta=True): what each completion gained, as
        rows, without the RequestOutputs (the server's engine loop sends these)."""
        return self.output_processor.deltas(self.requests, self._step())

    def _step(self) -> dict[str, Request]:
        """Run a step; → the requests that progressed in the step it completes."""
        if self.forwarded is not None or self._grammar_in_flight():
            return self._grammar_step()
        batch = self.scheduler.schedule()
        if batch.num_steps > 1:
            tokens = self.runner.execute_multi_step(batch).tolist()  # the steps' one device → host sync
            return self.process_multi_step(batch, tokens)
        launched = self.launch(batch) if batch.seqs else None
        if not self.async_scheduling:
            done = launched
        else:
            done, self.in_flight = self.in_flight, launched
        if done is None:
            # The cache holds a whole max_model_len request, so with work queued a step always runs something.
            assert self.in_flight is not None or not self.scheduler.has_unfinished(), \
                "the scheduler could not run any queued sequence"
            return {}
        return self.process(done)

    def _grammar_step(self) -> dict[str, Request]:
        """A step while a grammar row's next mask needs the token in flight (async scheduling). Step N+1's
        forward is queued first (by the call before, or here); while the device runs it, step N is read back
        (its tokens reach the grammars), N+1's masks are filled and step N+2 is scheduled; then N+1's sampler
        and N+2's forward are queued back to back, and the host's reading, filling and scheduling never stand
        between the device's steps. → the requests that step N progressed."""
        if self.forwarded is None:  # entering: queue N+1's forward
            batch = self.scheduler.schedule()
            assert batch.num_steps == 1, "multi-step decode excludes async scheduling"
            if not batch.seqs:
                done, self.in_flight = self.in_flight, None
                return self.process(done)
            self.forwarded = self.forward(batch)
        (batch, fwd), self.forwarded = self.forwarded, None
        progressed = self.process(self.in_flight) if self.in_flight is not None else {}
        tensors = self.runner.sampling_inputs(fwd, self.in_flight)  # N+1's masks: N's tokens are in the grammars
        self.add_pending(fwd.seqs)
        next_batch = self.scheduler.schedule()  # N+2 (its sequences hold N+1's PENDING tokens)
        assert next_batch.num_steps == 1, "multi-step decode excludes async scheduling"
        self.in_flight = InFlightStep.launch(batch, *self.runner.sample(fwd, tensors))
        if any(s.grammar is not None for s in next_batch.seqs):
            self.forwarded = self.forward(next_batch)  # sampled in the next call, once N+1 is read back
        elif next_batch.seqs:  # no grammar row in N+2: back to the usual overlap, one sampled step in flight
            launched = self.launch(next_batch)
            done, self.in_flight = self.in_flight, launched
            progressed.update(self.process(done))
        return progressed

    def forward(self, batch) -> tuple:
        """Queue a step's forward, not its sampler (_grammar_step): → (batch, runner.Forwarded)."""
        fwd = self.runner.forward(batch, self.in_flight)
        self.scheduler.mark_launched(batch)
        return batch, fwd

    def add_pending(self, seqs) -> None:
        """Each sequence that samples in a launched step holds a PENDING token until the step is read (one that
        finished since the step was queued gets none: its token will be dropped)."""
        for seq in seqs:
            if not seq.is_finished:
                seq.token_ids.append(PENDING)
                seq.num_pending += 1

    def _grammar_in_flight(self) -> bool:
        if not self.grammar_seqs or self.in_flight is None:
            return False
        return any(s.grammar is not None for s in self.in_flight.seqs)

    def launch(self, batch) -> InFlightStep:
        """Queue the step on the device, forward and sampler."""
        seqs, out, prompt = self.runner.execute(batch, self.in_flight)
        step = InFlightStep.launch(batch, seqs, out, prompt)
        self.scheduler.mark_launched(batch)
        self.add_pending(seqs)
        return step

    def process(self, step: InFlightStep) -> dict[str, Request]:
        """Read a launched step's tokens back (the step's one device → host sync) and hand them out;
        → the requests that progressed."""
        started = time.perf_counter()
        token_ids, lp = step.wait()
        self.device_wait_s += time.perf_counter() - started
        self.output_processor.fill_prompt_logprobs(step.prompt_spans())
        # Skipped: aborted, or stopped at the step before, after this one was launched.
        live = [i for i, seq in enumerate(step.seqs) if not seq.is_finished]
        seqs = [step.seqs[i] for i in live]
        lengths = []
        for seq, i in zip(seqs, live):  # the token takes the place of the sequence's first PENDING one
            known = seq.num_known_tokens
            seq.token_ids[known] = token_ids[i]
            seq.num_pending -= 1
            lengths.append(known + 1)
        tokens = [token_ids[i] for i in live]
        if self.grammar_seqs:
            accept_tokens(seqs, tokens)
        self.output_processor.check_tokens(seqs, tokens, None if lp is None else [lp[i] for i in live], lengths,
                                           self.eos_token_ids)
        if self.grammar_seqs:
            finish_terminated(seqs, self.scheduler)
            self.grammar_seqs = [s for s in self.grammar_seqs if not s.is_finished]
        progressed: dict[str, Request] = {}
        now = time.time()
        for seq in seqs:
            if seq.is_finished and seq.num_pending:  # a later step's token, which nobody will read
                del seq.token_ids[-seq.num_pending:]
                seq.num_pending = 0
            request = progressed[seq.request_id] = self.requests[seq.request_id]
            request.first_token_time = request.first_token_time or now
        self.scheduler.cache_computed(step.batch.seqs)
        return progressed

    def process_multi_step(self, batch, tokens: list[list[int]]) -> dict[str, Request]:
        """Hand out a multi-step decode's tokens step by step; a sequence's tokens after it finished
        are dropped (their pages were freed with it)."""
        for row in tokens:
            live = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
            seqs = [batch.seqs[i] for i in live]
            for seq, i in zip(seqs, live):
                self.scheduler.mark_computed(seq, 1)
                seq.token_ids.append(row[i])
            self.output_processor.check_tokens(seqs, [row[i] for i in live], None, [seq.num_tokens for seq in seqs],
                                               self.eos_token_ids)
        progressed = {seq.request_id: self.requests[seq.request_id] for seq in batch.seqs}
        now = time.time()
        for request in progressed.values():  # decode steps: every request already had its first token
            request.first_token_time = request.first_token_time or now
        return progressed

