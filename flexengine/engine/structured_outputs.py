"""Structured outputs on xgrammar: grammars compiled once per distinct spec, one matcher per sequence,
the allowed-token bitmask of a step's grammar rows filled on the host.

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)
    compiled = grammars.compile(params.structured_outputs)   # ValueError naming the spec when invalid
    seq.grammar = grammars.matcher(compiled)
    mask = fill_token_mask(seqs, rows, device)              # per step, for the rows that have one
    ... the sampler sets every disallowed token's logit to -inf ...
    accept_tokens(seqs, tokens)                             # each sampled token advances its matcher

xgrammar is imported on the first structured request, so requests without one never load it. Its compile
releases the GIL, so `submit` compiles on a worker thread while the engine steps (the server's engine
loop admits the request when it is done); the cache is an LRU on the spec's canonical JSON, errors included.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..layers.sampler import NO_LIMIT, TokenMask
from ..structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512  # a compiled JSON schema is ~60-120 KB at a 49k vocabulary (SmolLM2's)
MISSING_EXTRA = ("structured outputs need the xgrammar package, which is not installed: "
                 "pip install 'flexengine[structured]'")


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(f"structured_outputs: {MISSING_EXTRA}") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (JSON's string escapes are xgrammar's EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error without its C++ log prefix ("[03:46:09] /project/cpp/x.cc:83: ")."""
    text = str(error).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
    return text.splitlines()[0] if text else type(error).__name__


WHAT = {"json": "invalid JSON schema", "regex": "invalid regex", "choice": "invalid choice",
        "grammar": "invalid grammar", "json_object": "invalid JSON grammar"}


class Grammars:
    """The xgrammar compiler for one tokenizer and its cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compiler = None  # built on first use
        self.cache: OrderedDict[str, object] = OrderedDict()  # key → CompiledGrammar, or the ValueError message
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.compile_seconds: dict[str, float] = {}  # key → how long its compile took (benchmarks read it)

    def _compiler(self):
        with self.lock:  # the engine's thread and the compile worker may both get here first
            if self.compiler is None:
                self._build_compiler()
        return self.compiler

    def _build_compiler(self) -> None:
        xgr = import_xgrammar()
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer, and this model has none")
        started = time.perf_counter()
        # xgrammar sees the tokenizer's ids only. A model's vocabulary may be larger (padded embeddings):
        # the sampler bans the ids past them (TokenMask.limit). Sized for the model instead,
        # xgrammar clears each padded id on every fill: 88 µs a row inside a JSON string at 128,256 ids
        # against 4.4 µs at SmolLM2's own 49,152 (CPU), and the random presets pad 259 ids to 128,256.
        size = len(self.tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self.grammar_vocab_size = info.vocab_size  # the tokenizer's ids, which a row's bitmask covers
        # One thread: xgrammar's default (half the cores) filled 256 rows in 1.2-3.6 ms on the H100 box, one thread
        # in 0.19-0.23 ms (scripts/grammar_fill_probe.py, session 21): its workers wait on torch's busy OpenMP ones
        self.batch = xgr.BatchGrammarMatcher(1)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached here, by our key
        logger.info("structured outputs: xgrammar ready for a %d-token vocabulary in %.2f s", info.vocab_size,
                    time.perf_counter() - started)

    def cached(self, spec: StructuredOutputsParams) -> bool:
        with self.lock:
            return spec.key() in self.cache

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); ValueError naming it when it does not compile."""
        hit = self.lookup_or_compile(spec)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def lookup_or_compile(self, spec: StructuredOutputsParams):
        """The cache's entry for `spec`, compiled first on a miss: a CompiledGrammar, or the message of the
        spec's error. A missing xgrammar or tokenizer raises (it is not the spec's fault, so not cached)."""
        key = spec.key()
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
        if hit is None:
            compiler = self._compiler()  # a missing xgrammar or tokenizer is not cached: it is not the spec's
            started = time.perf_counter()
            try:
                hit = self._compile(compiler, spec)
            except RuntimeError as e:  # xgrammar's parse and conversion errors
                hit = f"structured_outputs.{spec.kind}: {WHAT[spec.kind]}: {xgrammar_message(e)}"
            with self.lock:
                self.compile_seconds[key] = time.perf_counter() - started
                self.cache[key] = hit
                while len(self.cache) > MAX_CACHED_GRAMMARS:
                    self.compile_seconds.pop(self.cache.popitem(last=False)[0], None)
        return hit

    @staticmethod
    def _compile(compiler, spec: StructuredOutputsParams):
        kind = spec.kind
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec.schema()), any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        return compiler.compile_grammar(choice_grammar(spec.choice) if kind == "choice" else spec.grammar)

    def submit(self, spec: StructuredOutputsParams) -> Future | None:
        """Compile on a worker thread; None when the spec is already cached (nothing to wait for)."""
        if self.cached(spec):
            return None
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="flexengine-grammar")
        # The future's outcome is in the cache; add_request reads it there (and raises the spec's error).
        return self.pool.submit(self.lookup_or_compile, spec)

    def matcher(self, compiled) -> "GrammarState":
        xgr = import_xgrammar()
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None),
                            vocab_size=self.grammar_vocab_size, batch=self.batch)


@dataclass(eq=False)
class GrammarState:
    """A sequence's matcher: where its output stands in the grammar."""
    matcher: object
    vocab_size: int              # the tokenizer's ids, which its bitmask covers
    batch: object                # the engine's xgrammar.BatchGrammarMatcher
    rejected: int | None = None  # a token the grammar did not allow (only if every token was banned)

    @property
    def width(self) -> int:
        """int32 words of its bitmask."""
        return -(-self.vocab_size // 32)


def fill_token_mask(seqs, rows, device) -> TokenMask | None:
    """Every row's allowed next tokens (TokenMask): the grammar rows' filled on the host by their matchers
    (xgrammar's batch_fill_next_token_bitmask), the others' all allowed, then one copy to the device. A
    sequence that finished after the step was queued (its grammar may be done) is left unmasked: its token is
    dropped."""
    rows = [row for row in rows if not seqs[row].is_finished]
    if not rows:
        return None
    first = seqs[rows[0]].grammar
    device = torch.device(device)
    # Filled where the copy reads it: pinned on CUDA (torch's caching host allocator reuses the block once
    # its copy is done). A row is 4,008 words at a 128k vocabulary, so 256 rows are 4 MB a step, which a
    # copy through the staging ring would first move into pinned memory on the host.
    # Each its own device tensor (not a view into the staging ring): the compiled sampler was warmed up with
    # such, and dynamo guards a storage offset of 0 or 1.
    pinned = device.type == "cuda"
    bitmask = torch.empty((len(seqs), first.width), dtype=torch.int32, pin_memory=pinned)
    limit = torch.full((len(seqs),), NO_LIMIT, dtype=torch.int32, pin_memory=pinned)
    limit.numpy()[rows] = first.vocab_size
    if len(rows) < len(seqs):
        bitmask.numpy()[limit.numpy() == NO_LIMIT] = -1
    assert not any(seqs[row].num_pending for row in rows), \
        "a grammar row's last token must be on the host before its mask is filled"
    first.batch.batch_fill_next_token_bitmask([seqs[row].grammar.matcher for row in rows], bitmask, rows)
    return TokenMask(bitmask=bitmask.to(device, non_blocking=True), limit=limit.to(device, non_blocking=True))


def accept_tokens(seqs, tokens) -> None:
    """Advance each grammar sequence's matcher by its new token. A token the grammar refuses can only come
    from a row whose every token was banned (min_tokens holding back the EOS a finished grammar needs):
    it is kept, and the sequence ends with it (finish_terminated)."""
    pairs = [(seq, token) for seq, token in zip(seqs, tokens) if seq.grammar is not None and seq.grammar.rejected is None]
    if not pairs:
        return
    batch = pairs[0][0].grammar.batch
    accepted = batch.batch_accept_token([seq.grammar.matcher for seq, _ in pairs], [token for _, token in pairs])
    for (seq, token), ok in zip(pairs, accepted):
        if not ok:
            seq.grammar.rejected = token
            logger.warning("request %s: the grammar refused token %d (every token was banned: min_tokens with a "
                           "finished grammar?); ending the completion", seq.request_id, token)


def finish_terminated(seqs, scheduler) -> None:
    """A sequence whose grammar is done (it accepted EOS, even with ignore_eos) or refused a token stops."""
    for seq in seqs:
        state = seq.grammar
        if state is not None and not seq.is_finished and (state.rejected is not None or state.matcher.is_terminated()):
            if seq.detokenizer is not None and seq.text_at_end:  # as check_tokens does for a stop
                seq.text += seq.detokenizer.emitted_by_add()
            scheduler.finish(seq, "stop")
