"""OpenAI request/response bodies (pydantic), with vLLM's extra sampling fields.

Requests are strict: "5" is not an integer and true is not a number, as OpenAI answers; a wrong value
fails validation naming its field, and the server turns that into a 400.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from flexengine.sampling_params import SamplingParams
from flexengine.structured_outputs import StructuredOutputsParams

# Where a request may ask for structured output: OpenAI's field, vLLM's extra, vLLM's older extras.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only for /v1/completions with echo: the prompt alone
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) → bias
    # vLLM's extra sampling fields
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Structured outputs (checked by structured_outputs_params, compiled by the engine)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Fields that change the output and that this server does not honour: a 400 naming them, never
    # dropped in silence.
    tools: Any = None

    def unsupported_field(self) -> str | None:
        """The first field set to a value the engine cannot honour (the server answers 400 naming it)."""
        return "tools" if self.tools is not None else None

    def structured_fields(self) -> list[str]:
        """The fields that ask for structured output (a response_format of type text does not)."""
        return [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None and
                not (name == "response_format" and self.response_format == {"type": "text"})]

    def structured_field(self) -> str | None:
        given = self.structured_fields()
        return given[0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the request's structured-output field asks for; ValueError, starting with the field's name,
        for a malformed one or for two fields that both ask."""
        given = self.structured_fields()
        if not given:
            return None
        name = given[0]
        if len(given) > 1:
            raise ValueError(f"{name}: only one of {', '.join(given)} may ask for structured output")
        value = getattr(self, name)
        if name == "response_format":
            return response_format_params(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
            value = {k: v for k, v in value.items() if k != "disable_fallback"}  # there is no other backend
            unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
            return StructuredOutputsParams(**value)
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)!r}") from None

    def to_sampling_params(self, default_max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the checkpoint's generation_config.json sampling fields, for those this request
        leaves out (vLLM's --generation-config auto)."""
        chosen = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        chosen.update({k: v for k, v in (defaults or {}).items() if k in chosen and k not in self.model_fields_set})
        return SamplingParams(
            n=self.n, temperature=chosen["temperature"], top_p=chosen["top_p"], top_k=chosen["top_k"],
            min_p=chosen["min_p"],
            seed=self.seed, max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=chosen["repetition_penalty"],
            logit_bias=self.logit_bias_ids(), min_tokens=self.min_tokens,
            structured_outputs=self.structured_outputs_params())


def response_format_params(value) -> StructuredOutputsParams:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}} (vLLM's mapping: any JSON object or array, and the schema)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format of type json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"response_format: type must be one of text, json_object, json_schema; got {kind!r}")


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_field(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        return super().unsupported_field()

    def prompt_list(self) -> list[str | dict]:
        """One engine prompt per entry: strings as they are, token ids as {"prompt_token_ids": [...]}."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True                    # vLLM extra

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses -------------------------------------------------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # with echo, the prompt's first token has none (null)
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # OpenAI sends {"content": "..."}, not "role": null


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "flexengine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
