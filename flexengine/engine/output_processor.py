"""Tokens read back from a step → the request's state and what it reports: logprobs, incremental text,
stop tokens and strings, length limits, then RequestOutputs (cumulative or, with delta, only what is new)
or CompletionDelta rows for the server's stream."""
from __future__ import annotations

import time

from ..outputs import CompletionDelta, CompletionOutput, Logprob, RequestMetrics, RequestOutput, logprob_entries
from ..tokenizer import add_tokens
from .scheduler import Scheduler
from .sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, max_model_len: int):
        self.tokenizer, self.scheduler, self.max_model_len = tokenizer, scheduler, max_model_len
        self.token_texts: dict[int, str] = {}  # a token's text alone, as logprobs name it (decode_one)

    def outputs(self, requests: dict[str, Request], progressed: dict[str, Request]) -> list[RequestOutput]:
        """RequestOutputs of the requests that progressed; finished ones leave `requests`."""
        outputs = []
        for r in progressed.values():
            finished = r.finished  # once: a streamed request is checked every step
            if finished or not r.final_only:
                outputs.append(self.make_output(r, finished))
            if finished:
                del requests[r.request_id]
        return outputs

    def deltas(self, requests: dict[str, Request], progressed: dict[str, Request]) -> list[CompletionDelta]:
        """What each completion of the progressed (streamed) requests gained, as rows."""
        rows = []
        for r in progressed.values():
            assert r.delta, f"step_deltas() streams requests added with delta=True; {r.request_id} was not"
            cached = r.num_cached_tokens
            for seq in r.seqs:
                prompt_logprobs = r.seqs[0].prompt_logprobs if not seq.num_sent_tokens else None
                text, token_ids, logprobs, cumulative = self.new_output(seq, delta=True)
                rows.append(CompletionDelta(r.request_id, seq.index, text, token_ids, logprobs, cumulative,
                                            seq.finish_reason, seq.stop_reason, cached, prompt_logprobs))
            if r.finished:
                del requests[r.request_id]
        return rows

    def check_tokens(self, seqs: list[Sequence], tokens: list[int], lps: list | None, lengths: list[int],
                     eos_token_ids: frozenset[int]) -> None:
        """Each sequence's token just became known, at position lengths[i] - 1: logprobs, text (the step's
        sequences detokenized in one pass), stop tokens, stop strings, limits."""
        stop_tokens, streamed = [], []
        for k, (seq, token) in enumerate(zip(seqs, tokens)):
            params = seq.params
            if seq.logprobs is not None:
                seq.logprobs.append(self.logprob_dict(token, lps[k], params.logprobs))
                seq.cumulative_logprob += lps[k][0]
            stop = token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
            stop_tokens.append(stop)
            if seq.detokenizer is not None and not stop:  # a stop token's text is not part of the output
                if seq.text_at_end:
                    seq.detokenizer.ids.append(token)
                else:
                    streamed.append(k)
        deltas = add_tokens([seqs[k].detokenizer for k in streamed], [tokens[k] for k in streamed])
        for k, delta in zip(streamed, deltas):
            seq = seqs[k]
            seq.text += delta
            if seq.params.stop and delta and lengths[k] - seq.num_prompt_tokens >= seq.params.min_tokens:
                self.check_stop_strings(seq, len(delta))
        for seq, token, stop, num_tokens in zip(seqs, tokens, stop_tokens, lengths):
            params, detok = seq.params, seq.detokenizer
            if seq.is_finished:  # by a stop string
                continue
            if stop:
                if detok is not None and seq.text_at_end:
                    seq.text += detok.emitted_by_add()  # a stop drops an unfinished character, as in streaming
                seq.stop_reason = token if token in params.stop_token_ids else None
                self.scheduler.finish(seq, "stop")
            elif seq.reaches_length_limit(num_tokens, self.max_model_len):
                if detok is not None:
                    seq.text += detok.flush()
                self.scheduler.finish(seq, "length")

    def fill_prompt_logprobs(self, spans) -> None:
        """Prompt logprobs read back from a step (InFlightStep.prompt_spans), into their sequences' arrays; a
        position recomputed after a preemption gets the same values again."""
        for seq, first, arrays in spans:
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs.fill(first, *arrays)

    def check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        """Cut the text just before the earliest stop string that the new text completes."""
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, len(seq.text) - delta_len - longest + 1)
        found = [(seq.text.find(s, start), s) for s in seq.params.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        index, stop = min(found)
        seq.text, seq.stop_reason = seq.text[:index], stop
        self.scheduler.finish(seq, "stop")
        return True

    def logprob_dict(self, token: int, lp, k: int) -> dict[int, Logprob]:
        chosen, rank, top_ids, top_lps = lp
        return logprob_entries(token, chosen, rank, top_ids[:k], top_lps[:k], self.decode_one)

    def decode_one(self, token: int) -> str | None:
        """Cached: prompt logprobs name two tokens per prompt position, and a tokenizer's decode of one
        took most of a loglikelihood request's host time (issue 20's 1,000 × 256 workload)."""
        if self.tokenizer is None:
            return None
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tokenizer.decode([token])
        return text

    @staticmethod
    def new_output(seq: Sequence, delta: bool) -> tuple[str, list[int], list | None, float | None]:
        """The completion's (text, token ids, logprobs, cumulative logprob) to report: all so far, or
        with delta only what is new since the last report (which this marks as sent)."""
        text = seq.text
        if seq.params.stop and not seq.is_finished:
            # Hold back what might be the start of a stop string, so cumulative text never shrinks.
            hold = max(len(s) for s in seq.params.stop) - 1
            text = text[:max(0, len(text) - hold)]
        first = 0  # of the output tokens
        if delta:
            assert len(text) >= seq.num_sent_chars, "the visible text shrank"
            text, seq.num_sent_chars = text[seq.num_sent_chars:], len(text)
            first, seq.num_sent_tokens = seq.num_sent_tokens, seq.num_known_tokens - seq.num_prompt_tokens
        token_ids = seq.token_ids[seq.num_prompt_tokens + first:seq.num_known_tokens]  # a fresh slice
        if seq.logprobs is None:
            return text, token_ids, None, None
        return text, token_ids, seq.logprobs[first:], seq.cumulative_logprob

    def make_output(self, request: Request, finished: bool) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text, token_ids, logprobs, cumulative = self.new_output(seq, request.delta)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids, cumulative_logprob=cumulative, logprobs=logprobs,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        prompt_ids = request.prompt_token_ids if request.delta else list(request.prompt_token_ids)
        metrics = RequestMetrics(request.arrival_time, request.first_token_time, time.time() if finished else None)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=prompt_ids, outputs=completions, finished=finished,
                             prompt_logprobs=request.seqs[0].prompt_logprobs,
                             num_cached_tokens=request.num_cached_tokens, metrics=metrics)
