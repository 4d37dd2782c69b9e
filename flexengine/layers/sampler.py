"""Token sampling on the device: temperature, min-p, top-k, top-p, then an exponential race.

Sampling from p is done as argmax(p / E) with E ~ Exp(1) i.i.d. per token (the Gumbel-max trick in
another form). A row with a seed draws E from its own torch.Generator, so its tokens depend only on
its seed and its logits, never on which other requests share the batch. Nothing here syncs with the
host; the caller's single `.tolist()` of the ids is the step's only sync.

Logprobs are those of the raw model distribution (vLLM's default), with the chosen token's rank; a
grammar row's are those of its masked logits, as vLLM's (it masks the logits before its sampler).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..compile import fused, fused_elementwise


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, already on the device."""
    temperature: torch.Tensor               # float32 [N]; 0 → greedy
    top_k: torch.Tensor | None = None       # int64 [N]; vocab size where disabled; None: no row uses it
    top_p: torch.Tensor | None = None       # float32 [N]; 1 where disabled
    min_p: torch.Tensor | None = None       # float32 [N]; 0 where disabled
    generators: tuple = ()                  # per row: torch.Generator or None (then the sampler's own)
    all_greedy: bool = False
    num_logprobs: int = -1                  # largest `logprobs` of the step's rows; -1: none asked
    adjust: "LogitsAdjust | None" = None    # penalties, biases, min_tokens bans; None: no row has any
    grammar_rows: tuple[int, ...] = ()      # host: rows whose sequence has a grammar (their mask is per step)
    adjusts_logits: bool = False            # host: some row has penalties, biases or min_tokens (`adjust` per step)
    token_mask: "TokenMask | None" = None   # every row's allowed tokens, when some row has a grammar
    #                                         (engine/structured_outputs.py fills it)


@dataclass
class LogitsAdjust:
    """vLLM's logits processors for one step, in its order: min_tokens bans, logit_bias, then the
    repetition, frequency and presence penalties. The penalties work at each penalised row's history
    (prompt and output token ids), not over the vocabulary; their rows without one carry neutral values."""
    banned: tuple[torch.Tensor, torch.Tensor] | None   # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) added
    rows: torch.Tensor | None = None         # int64 [P]: the penalised rows; None: no penalties
    tokens: torch.Tensor | None = None       # int64 [P, L]: their token ids; columns past a history repeat one of its tokens
    is_output: torch.Tensor | None = None    # bool [P, L]: the column holds an output token
    repetition: torch.Tensor | None = None   # float32 [P]: 1 where off
    frequency: torch.Tensor | None = None    # float32 [P]
    presence: torch.Tensor | None = None     # float32 [P]


def apply_adjust(logits: torch.Tensor, a: LogitsAdjust, in_place: bool = False, compiled: bool = False) -> torch.Tensor:
    """The adjusted logits; `in_place` writes them into `logits` (no [N, V] copy) where nothing reads the raw ones
    (but for one compiled row: `penalise`). `compiled`: the penalties through Inductor."""
    if not in_place:
        logits = logits.clone()
    if a.banned is not None:
        logits[a.banned] = float("-inf")
    if a.bias is not None:
        rows, ids, values = a.bias  # a row's ids are distinct (a dict's keys): no accumulate, whose CUDA kernel sorts
        logits[rows, ids] += values
    if a.rows is not None:
        logits = penalise(logits, a, compiled)
    return logits


def penalise(logits: torch.Tensor, a: LogitsAdjust, compiled: bool) -> torch.Tensor:
    """apply_penalties into `logits` (returned). Compiled, one penalised row gains a neutral second one (repetition 1,
    frequency and presence 0: it writes back the logits it read) on another row, after a copy of the logits where
    there is one row only, so that the graph of several rows serves it: dynamo would compile graphs of one row and
    one penalised row at start-up (~1.1 s each on an H200, session 49)."""
    rows, tokens, is_output, coefficients = a.rows, a.tokens, a.is_output, (a.repetition, a.frequency, a.presence)
    n = logits.shape[0]
    if compiled and len(rows) == 1:
        if n == 1:
            logits, = two_rows(logits)
        rows = torch.cat([rows, (rows + 1) % logits.shape[0]])
        tokens, is_output = tokens.repeat(2, 1), is_output.repeat(2, 1)
        rep, freq, pres = coefficients
        coefficients = (torch.cat([rep, torch.ones_like(rep)]), torch.cat([freq, torch.zeros_like(freq)]),
                        torch.cat([pres, torch.zeros_like(pres)]))
    with fused_elementwise(compiled):
        apply_penalties(logits, rows, tokens, is_output, *coefficients)
    return logits[:n]


def two_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One-row tensors with their row twice (copies: a stride of 0 would be a graph of its own), so that a compiled
    function's graph of several rows serves one row: dynamo specialises a size of 1 (a graph compiled at start-up)."""
    return tuple(t.expand(2, *t.shape[1:]).contiguous() for t in tensors)


@fused(static_vocab=True)
def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, is_output: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """The repetition, frequency and presence penalties (LogitsAdjust), into `logits`. Compiled on the CUDA engine:
    eagerly they were nine launches a step, ~1 ms of host time at 256 penalised rows (session 20's H100 run)."""
    counts = torch.zeros(len(rows), logits.shape[1], device=logits.device)
    counts.scatter_add_(1, tokens, is_output.float())  # each token's occurrences in the output
    n = counts.gather(1, tokens)
    x, r = logits[rows[:, None], tokens], repetition[:, None]
    x = torch.where(x > 0, x / r, x * r) - frequency[:, None] * n - presence[:, None] * (n > 0)
    logits[rows[:, None], tokens] = x  # a token repeated in the history gets the same value each time


NO_LIMIT = 2 ** 31 - 1  # TokenMask.limit of a row without a grammar


@dataclass
class TokenMask:
    """The allowed next tokens of every row of a step, in xgrammar's bitmask layout. A row without a grammar
    allows every token: its words are -1 (every bit) and its limit NO_LIMIT. Every row, not only the grammar
    rows: the mask is then a pointwise op over the logits, which the sampling kernel applies as it reads them
    (no gather and scatter of the grammar rows)."""
    bitmask: torch.Tensor   # int32 [N, W]: bit j of word k allows token 32k + j (ids past 32W: allowed below limit)
    limit: torch.Tensor     # int32 [N]: ids from limit on are never allowed: a grammar row's tokenizer vocabulary
    #                         (a model's embeddings may be padded past it; xgrammar sets whole words inside a JSON
    #                         string, its bits past the vocabulary too), NO_LIMIT in a row without a grammar


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """-inf for each token a row does not allow (TokenMask), the bits unpacked to bytes first: plain tensor ops,
    the CPU engine's way (2x faster eagerly than a word per logit). Writes into `logits`."""
    N, V = logits.shape
    W = bitmask.shape[1]
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    # little-endian bytes of each word: byte b holds tokens 32k + 8b ... 32k + 8b + 7
    allowed = ((bitmask.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1).view(N, W * 32)[:, :V].bool()
    if 32 * W < V:  # ids past the words: allowed below the limit
        allowed = torch.cat([allowed, allowed.new_ones(N, V - 32 * W)], dim=1)
    allowed &= torch.arange(V, device=logits.device) < limit[:, None]
    return logits.masked_fill_(~allowed, float("-inf"))


def token_allowed(bitmask: torch.Tensor, limit: torch.Tensor, V: int) -> torch.Tensor:
    """bool [N, V]: TokenMask's rule, a word per logit (traced into the kernel that reads the logits, Inductor
    never writes it out)."""
    W = bitmask.shape[1]
    ids = torch.arange(V, device=bitmask.device)
    words = bitmask[:, torch.clamp(ids // 32, max=W - 1)]
    bit = ((words >> (ids % 32).to(torch.int32)) & 1).bool() | (ids >= 32 * W)
    return bit & (ids < limit[:, None])


@fused(static_vocab=True)
def mask_by_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """apply_token_mask as the CUDA engine runs it where the sampling kernel cannot take the mask (logprobs,
    logits processors, top-k/p, greedy batches): one pointwise kernel through Inductor. Writes into `logits`."""
    return logits.masked_fill_(~token_allowed(bitmask, limit, logits.shape[-1]), float("-inf"))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # int64 [N]
    logprob: torch.Tensor | None = None     # float32 [N]: the chosen token's logprob
    rank: torch.Tensor | None = None        # int64 [N]: its rank (1 = most likely)
    top_ids: torch.Tensor | None = None     # int64 [N, K]
    top_logprobs: torch.Tensor | None = None  # float32 [N, K]


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t[:, None]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(-1)
    threshold = min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top_k most likely tokens, then the smallest head of them whose mass reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(V, device=logits.device)[None, :] >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_noise(shape, device, generators, default: torch.Generator | None) -> torch.Tensor:
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=default)
    for row, gen in enumerate(generators):
        if gen is not None:
            q[row].exponential_(generator=gen)  # this row's draw depends on its seed alone
    return q


@fused(static_vocab=True)
def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor):
    """Each row's token: its logprob (float32 [N]) and rank (int64 [N]); the row's logsumexp, its largest logit
    (float32 [N, 1]) and that logit's id (int64 [N, 1]). The log-softmax is never written out: prompt logprobs
    score every prompt row, and [rows, vocab] in float32 is 0.5 GB per thousand rows at a 128k vocabulary.
    Compiled (the CUDA engine), the reductions read the logits in one or two passes."""
    x = logits.float()
    lse = torch.logsumexp(x, -1, keepdim=True)
    chosen = x.gather(-1, token_ids[:, None])
    rank = (x >= chosen).sum(-1)  # ties count as ahead, as vLLM does (logits rank as their logprobs)
    best, best_id = x.max(-1, keepdim=True)  # the top 1, in the same passes (topk is a pass of its own)
    return (chosen - lse)[:, 0], rank, lse, best, best_id


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, compiled: bool = False):
    """(logprob of each row's token, its rank, the top k ids and logprobs), from logits of any dtype;
    `compiled`: token_logprobs through Inductor (the prompt-logprob scoring of the CUDA engine, in the model
    dtype, warmed up by compile/warmup.warm_up_sampling; a sampled token's logprobs are few rows, eager)."""
    n = logits.shape[0]
    if compiled and n == 1:  # one compiled graph for every row count: dynamo would specialise a size-1 one
        logits, token_ids = two_rows(logits, token_ids)
    with fused_elementwise(compiled):
        chosen, rank, lse, best, best_id = token_logprobs(logits, token_ids)
    chosen, rank, lse, logits = chosen[:n], rank[:n], lse[:n], logits[:n]
    if k == 1:  # lm-eval's loglikelihood requests
        return chosen, rank, best_id[:n], best[:n] - lse
    top = logits.topk(k, dim=-1)
    return chosen, rank, top.indices, top.values.float() - lse


# The chunk counts row_argmax tries, largest first: the first that divides the vocabulary. Llama 3's 128,256 takes 256
# chunks of 501 logits, rows that start off 16-byte alignment, so CUDA's reduction reads them without vector loads;
# 64 chunks of 2,004 are aligned (issue 16: the max pass was 10 µs at batch 32, session 37's profile;
# scripts/decode_step_probe.py argmax_chunks=64 times it)
ARGMAX_CHUNKS = (256, 128, 64, 32, 16)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for [N, V], in two passes where N is small: CUDA's reduction gives each output row one block,
    so one row of a 128k vocabulary took 28 µs on the H100 (session 18's batch-1 profile), and 32 rows 27 µs (session
    25's): one block per row leaves most SMs idle until there are about as many rows as SMs. Each of S chunks
    first gives its first maximum, then the first chunk holding the row's maximum wins: the first maximal
    index, as argmax gives it (NaN counts as the maximum in both)."""
    N, V = x.shape
    S = next((s for s in ARGMAX_CHUNKS if V % s == 0), 1)
    if S == 1 or (not torch.compiler.is_compiling() and N >= 128):  # (traced: one graph for every N, no guard on N)
        return x.argmax(-1)
    best, where = x.view(N, S, V // S).max(-1)  # [N, S]
    chunk = best.argmax(-1, keepdim=True)
    return (chunk * (V // S) + where.gather(1, chunk)).squeeze(1)


@fused(static_vocab=True)
def temperature_sample(logits: torch.Tensor, temperature: torch.Tensor, q: torch.Tensor,
                       mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows with temperature > 0: the Gumbel-max draw argmax(softmax(logits / T) / q); the others: greedy. Compiled
    (the CUDA engine), the passes over [N, V] fuse into a few kernels instead of eight launches. `mask`: a
    TokenMask's (bitmask, limit), applied as the logits are read (JSON mode costs no pass of its own)."""
    if mask is not None:
        logits = logits.masked_fill(~token_allowed(*mask, logits.shape[-1]), float("-inf"))
    greedy = row_argmax(logits)
    sampled = row_argmax(apply_temperature(logits, temperature).softmax(-1) / q.clamp_min(1e-20))
    return torch.where(temperature > 0, sampled, greedy)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None, compiled: bool = False):
        self.generator = generator  # for rows without their own seed
        self.compiled = compiled    # temperature_sample through Inductor (warm_up compiles it at start-up)

    def warm_up(self, vocab_size: int, device) -> None:
        """Compile temperature_sample and the penalties, and, where xgrammar is installed (JSON mode),
        temperature_sample's masked version and the token mask: a first such request would otherwise wait for them.
        One graph each, of several rows: one row runs on it as two (`two_rows`, `penalise`)."""
        masks = self.compiled and importlib.util.find_spec("xgrammar") is not None
        with torch.inference_mode(), fused_elementwise(self.compiled):
            n = 2  # (one row runs as two: two_rows)
            logits, t = torch.zeros(n, vocab_size, device=device), torch.ones(n, device=device)
            q = torch.ones(n, vocab_size, device=device)
            temperature_sample(logits, t, q)
            if masks:
                mask = TokenMask(torch.zeros(n, -(-vocab_size // 32), dtype=torch.int32, device=device),
                                 torch.full((n,), NO_LIMIT, dtype=torch.int32, device=device))
                temperature_sample(logits, t, q, (mask.bitmask, mask.limit))
                self.mask(logits, mask)
            # penalised rows P = 2 of a step of 3, histories of 5: sizes that differ (dynamo would take equal ones
            # for one); one row or one penalised row runs as two (penalise)
            P, tokens = 2, torch.zeros(2, 5, dtype=torch.int64, device=device)
            apply_penalties(torch.zeros(3, vocab_size, device=device), torch.arange(P, device=device), tokens,
                            tokens > 0, *(torch.ones(P, device=device) for _ in range(3)))

    def mask(self, logits: torch.Tensor, m: TokenMask) -> torch.Tensor:
        """The disallowed tokens to -inf, in place (a compiled row alone: in a copy, `two_rows`), returned: compiled on
        the CUDA engine, unpacked on a CPU."""
        if not self.compiled:
            return apply_token_mask(logits, m.bitmask, m.limit)
        n = logits.shape[0]
        args = two_rows(logits, m.bitmask, m.limit) if n == 1 else (logits, m.bitmask, m.limit)
        with fused_elementwise(True):
            return mask_by_bitmask(*args)[:n]

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits float32 [N, V] → one token per row."""
        plain_draw = not t.all_greedy and t.min_p is None and t.top_k is None and t.top_p is None
        # the sampling kernel masks as it reads, unless the masked logits are read elsewhere too
        folded = t.token_mask is not None and self.compiled and plain_draw and t.adjust is None and t.num_logprobs < 0
        if t.token_mask is not None and not folded:
            logits = self.mask(logits, t.token_mask)
        raw = logits  # logprobs are the model's own (vLLM's raw_logprobs), before the adjustments
        if t.adjust is not None:
            logits = apply_adjust(logits, t.adjust, in_place=t.num_logprobs < 0, compiled=self.compiled)
        if t.all_greedy:
            ids = row_argmax(logits)
        elif plain_draw:
            q = exponential_noise(logits.shape, logits.device, t.generators, self.generator)
            args = (logits, t.temperature, q) + ((t.token_mask.bitmask, t.token_mask.limit) if folded else ())
            n = logits.shape[0]
            if self.compiled and n == 1:
                args = two_rows(*args)
            with fused_elementwise(self.compiled):
                ids = temperature_sample(*args[:3], args[3:] or None)[:n]
        else:
            x = apply_temperature(logits, t.temperature)
            if t.min_p is not None:
                x = apply_min_p(x, t.min_p)
            if t.top_k is not None or t.top_p is not None:
                x = apply_top_k_top_p(x, t.top_k, t.top_p)
            q = exponential_noise(x.shape, x.device, t.generators, self.generator)
            sampled = row_argmax(x.softmax(-1) / q.clamp_min(1e-20))
            ids = torch.where(t.temperature > 0, sampled, row_argmax(logits))
        out = SamplerOutput(token_ids=ids)
        if t.num_logprobs >= 0:
            out.logprob, out.rank, out.top_ids, out.top_logprobs = compute_logprobs(raw, ids, t.num_logprobs)
        return out
