"""Engine outputs → OpenAI response bodies and stream chunks (completions and chat).

Stream chunks are JSON strings. A chunk without logprobs — nearly every chunk — is written from a
template per stream (`*_chunk` below) instead of through the pydantic models, which cost several
times more per token; tests check the template against the models byte for byte. Chunks with
logprobs go through the models (their floats must print as pydantic prints them).
"""
from __future__ import annotations

import json
import time
from typing import AsyncIterator

from flexengine.chat import chat_prompt_ids
from flexengine.outputs import Logprob, RequestOutput
from flexengine.server.async_engine import RequestGroup
from flexengine.server.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatStreamChoice, CompletionChoice, CompletionLogprobs, CompletionResponse, DeltaMessage,
    TokenLogprob, TopLogprob, UsageInfo)


# Compact and UTF-8, as pydantic's model_dump_json writes them.
dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def chunk_head(request_id: str, object_: str, created: int, model: str) -> str:
    """The start of every chunk of one stream, up to and including '"choices":['."""
    head = dumps({"id": request_id, "object": object_, "created": created, "model": model})
    return head[:-1] + ',"choices":['


def apply_chat_template(tokenizer, body: ChatCompletionRequest, chat_template: str | None = None) -> list[int]:
    """Prompt token ids from `chat_template` (serve --chat-template) or the tokenizer's; ValueError when
    there is none or it fails."""
    messages = [m.as_template_input() for m in body.messages]
    return chat_prompt_ids(tokenizer, messages, chat_template=chat_template,
                           add_generation_prompt=body.add_generation_prompt)[1]


def usage_of(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals if o is not None)
    completion = sum(len(c.token_ids) for o in finals if o is not None for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def token_text(tokenizer, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def ranked(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k entries of one token's logprob dict, most likely first."""
    items = sorted(entries.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                     -kv[1].logprob))
    return items[:k]


class CompletionWriter:
    def __init__(self, request_id: str, model: str, n: int, logprobs: int | None, tokenizer, echo: bool = False,
                 echo_only: bool = False):
        self.id, self.model, self.n, self.logprobs, self.tokenizer = request_id, model, n, logprobs, tokenizer
        # echo: each choice starts with the prompt (and its logprobs); echo_only (max_tokens=0): only that
        self.echo, self.echo_only = echo, echo_only
        self.created = int(time.time())  # one creation time for every chunk of a stream, as OpenAI's
        self.head = chunk_head(request_id, "text_completion", self.created, model)

    def text_chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        """The JSON of CompletionResponse(choices=[CompletionChoice(index, text, finish_reason)])."""
        return (f'{self.head}{{"index":{index},"text":{dumps(text)},"logprobs":null,'
                f'"finish_reason":{dumps(finish_reason)}}}],"usage":null}}')

    def _logprobs(self, token_ids: list[int], logprobs: list | None, text_offset: int,
                  out: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        """The legacy logprobs object of these tokens, appended to `out` when given. An entry None (the
        prompt's first token, with echo) has no logprob: null, as OpenAI writes it."""
        if self.logprobs is None or logprobs is None:
            return None
        out = out or CompletionLogprobs()
        for tid, entries in zip(token_ids, logprobs):
            if entries is None:
                token = token_text(self.tokenizer, tid, None)
                out.tokens.append(token)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                out.text_offset.append(text_offset)
                text_offset += len(token)
                continue
            token = token_text(self.tokenizer, tid, entries.get(tid))
            out.tokens.append(token)
            out.token_logprobs.append(entries[tid].logprob)
            out.top_logprobs.append({token_text(self.tokenizer, t, lp): lp.logprob
                                     for t, lp in ranked(entries, max(self.logprobs, 1))})
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, output in enumerate(finals):
            for c in output.outputs:
                prefix, logprobs = self.echoed(output.prompt, output.prompt_token_ids, output.prompt_logprobs)
                text, token_ids, lps, finish = self.generated(c.text, c.token_ids, c.logprobs, c.finish_reason)
                if self.logprobs is not None:
                    logprobs = self._logprobs(token_ids, lps, len(prefix), out=logprobs)
                choices.append(CompletionChoice(index=i * self.n + c.index, text=prefix + text, finish_reason=finish,
                                                logprobs=logprobs))
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=self.usage(finals))

    def echoed(self, prompt: str | None, prompt_ids: list[int],
               prompt_logprobs) -> tuple[str, CompletionLogprobs | None]:
        """With echo, what a choice starts with: the prompt's text (decoded where it came as token ids)
        and, with logprobs, its tokens' logprobs (the first null)."""
        if not self.echo:
            return "", None
        if prompt is None:
            prompt = self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else ""
        return prompt, self._logprobs(prompt_ids, prompt_logprobs, 0)

    def generated(self, text: str, token_ids: list[int], logprobs, finish_reason):
        """What a choice gained: none of it with echo and max_tokens=0 (its one token was not asked for)."""
        if self.echo_only:
            return "", [], [], finish_reason and "length"
        return text, token_ids, logprobs, finish_reason

    def usage(self, finals: list[RequestOutput]) -> UsageInfo:
        usage = usage_of(finals)
        if self.echo_only:
            usage = UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens)
        return usage

    async def stream(self, group: RequestGroup, include_usage: bool) -> AsyncIterator[str]:
        """JSON chunks: one per choice that gained tokens or finished since the last, then the usage."""
        text_len: dict[int, int] = {}  # per choice: text sent so far (the logprobs' text_offset)
        async for i, row in group.deltas():
            index = i * self.n + row.index
            prefix, logprobs = "", None
            if self.echo and index not in text_len:  # a choice's first chunk starts with the prompt
                state = group.states[i]
                prefix, logprobs = self.echoed(state.prompt, state.prompt_token_ids, state.prompt_logprobs)
            text, token_ids, lps, finish = self.generated(row.text, row.token_ids, row.logprobs, row.finish_reason)
            offset = text_len.get(index, 0)
            text_len[index] = offset + len(prefix) + len(text)
            if self.logprobs is None:
                yield self.text_chunk(index, prefix + text, finish)
                continue
            choice = CompletionChoice(index=index, text=prefix + text, finish_reason=finish,
                                      logprobs=self._logprobs(token_ids, lps, offset + len(prefix), out=logprobs))
            yield self._chunk([choice])
        if include_usage:
            yield self._chunk([], self.usage(group.results()))

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=usage).model_dump_json()


class ChatWriter:
    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int, tokenizer):
        self.id, self.model, self.n, self.top, self.tokenizer = request_id, model, n, top_logprobs, tokenizer
        self.created = int(time.time())  # one creation time for every chunk of a stream, as OpenAI's
        self.head = chunk_head(request_id, "chat.completion.chunk", self.created, model)

    def text_chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        """The JSON of ChatCompletionChunk(choices=[ChatStreamChoice(index, DeltaMessage(content=text),
        finish_reason)])."""
        return (f'{self.head}{{"index":{index},"delta":{{"content":{dumps(text)}}},"logprobs":null,'
                f'"finish_reason":{dumps(finish_reason)}}}],"usage":null}}')

    def _entry(self, token_id: int, lp: Logprob) -> dict:
        token = token_text(self.tokenizer, token_id, lp)
        return dict(token=token, logprob=lp.logprob, bytes=list(token.encode("utf-8")))

    def _logprobs(self, token_ids: list[int], logprobs: list | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        content = [TokenLogprob(**self._entry(tid, entries[tid]),
                                top_logprobs=[TopLogprob(**self._entry(t, lp)) for t, lp in ranked(entries, self.top)])
                   for tid, entries in zip(token_ids, logprobs)]
        return ChatLogprobs(content=content)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              finish_reason=c.finish_reason, logprobs=self._logprobs(c.token_ids, c.logprobs))
                   for c in final.outputs]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage_of([final]))

    async def stream(self, group: RequestGroup, include_usage: bool) -> AsyncIterator[str]:
        """JSON chunks: the role, one per choice that gained tokens or finished since the last, the usage."""
        # OpenAI opens every choice with the assistant role and empty content.
        for index in range(self.n):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for _, row in group.deltas():
            logprobs = self._logprobs(row.token_ids, row.logprobs)
            if logprobs is None:
                yield self.text_chunk(row.index, row.text, row.finish_reason)
                continue
            yield self._chunk([ChatStreamChoice(index=row.index, delta=DeltaMessage(content=row.text),
                                                finish_reason=row.finish_reason, logprobs=logprobs)])
        if include_usage:
            yield self._chunk([], usage_of(group.results()))

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump_json()
