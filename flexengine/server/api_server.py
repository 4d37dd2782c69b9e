"""`flexengine serve [MODEL]`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics. Requests join the
engine's running batch through AsyncEngine; a client that goes away has its request aborted. The engine
runs in its own process, built before the server listens, so /health answers only once it is ready.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import re
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flexengine.chat import read_chat_template
from flexengine.server.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestGroup
from flexengine.server.engine_process import EngineProcess, freeze_startup_heap, log_to_stderr
from flexengine.server.metrics import CONTENT_TYPE
from flexengine.server.protocol import (
    ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body, random_id)
from flexengine.server import responses
from flexengine.config import env_api_key

DISCONNECT_POLL_S = 0.05


class ApiError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.type, self.code), status_code=self.status)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its field ("body" and union-member tags stripped)."""
    err = exc.errors()[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    if err.get("type") == "json_invalid":
        return ApiError(400, f"Invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc:
        return ApiError(400, f"Invalid request body: {err['msg']}")
    return ApiError(400, f"Invalid value for '{'.'.join(loc)}': {err['msg']}", param=loc[0])


@asynccontextmanager
async def abort_on_disconnect(raw: Request, group: RequestGroup):
    """Abort the group when the client goes away (or the handler exits early), so its pages free now.

    For non-streaming handlers, which write nothing until the end, so only polling notices; a stream
    is an EventStreamResponse, which needs no poll.
    """
    async def watch():
        while not group.finished:
            if await raw.is_disconnected():
                group.abort()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        group.abort()  # no-op when every request finished


class EventStreamResponse(StreamingResponse):
    """Server-sent events for one request group, aborted however the response ends.

    StreamingResponse already watches for the client going away (it cancels the stream on
    http.disconnect) or fails the next write, so a stream needs no polling watcher; the `finally`
    turns either ending into an abort that the engine applies before its next step.
    """

    def __init__(self, events, group: RequestGroup):
        super().__init__(events, media_type="text/event-stream")
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()  # no-op when every request finished


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              model_root: str | None = None, chat_template: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="flexengine", lifespan=lifespan)
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    from ..llm import generation_config_defaults  # the checkpoint's sampling defaults (vLLM's generation-config auto)
    generation_defaults = generation_config_defaults(model_root) if model_root and os.path.isdir(model_root) else {}

    @app.exception_handler(ApiError)
    async def on_api_error(_, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)  # FastAPI would answer 422; OpenAI answers 400
    async def on_validation_error(_, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), code=exc.status_code).response()

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_, exc: EngineDeadError):
        return ApiError(500, str(exc), type_="server_error").response()

    async def check_api_key(raw: Request):
        if api_key is None:
            return
        given = raw.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                           code="invalid_api_key")

    def check_request(body) -> None:
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist.", param="model",
                           code="model_not_found")
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise ApiError(400, f"'{unsupported}' is not supported by this server.", param=unsupported)

    def field_named_in(message: str, body, default: str | None) -> str | None:
        # SamplingParams and the engine start their messages with the field ("max_tokens must ...").
        word = re.split(r"[\s:=]", message, maxsplit=1)[0]
        return word if word in type(body).model_fields else default

    def bad_request(message: str, body, default_param: str | None) -> ApiError:
        """A 400 naming the field at fault. A structured-output spec's errors name StructuredOutputsParams'
        fields ("structured_outputs.json: invalid JSON schema: ..."): the request field that carried it is
        the param, and leads the message when it is another (response_format, guided_json)."""
        source = body.structured_field()
        if source is not None and message.startswith("structured_outputs"):
            return ApiError(400, message if source == "structured_outputs" else f"{source}: {message}", param=source)
        return ApiError(400, message, param=field_named_in(message, body, default_param))

    def sampling_params(body, default_max_tokens, logprobs, prompt_logprobs=None):
        default_max_tokens = min(default_max_tokens, generation_defaults.get("max_tokens", default_max_tokens))
        try:
            return body.to_sampling_params(default_max_tokens, logprobs, prompt_logprobs, generation_defaults)
        except ValueError as e:
            raise bad_request(str(e), body, None) from e

    def check_context(prompt_ids: list[list[int]], max_tokens: int | None, param: str, what: str) -> None:
        """vLLM's 400 for a request whose prompt fits but whose prompt and max_tokens together pass
        max_model_len, instead of a request that runs until the context is full (a prompt that does not
        fit is the engine's 400, naming the prompt)."""
        for ids in prompt_ids:
            if max_tokens is not None and len(ids) <= max_model_len < len(ids) + max_tokens:
                raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} "
                               f"in the completion). Please reduce the length of the {what} or completion.",
                               param=param)

    async def submit(prompts: list, params, body, prompt_param: str) -> RequestGroup:
        try:
            group = engine.add_requests(prompts, params)
        except EngineOverloadedError as e:
            raise ApiError(429, str(e), type_="rate_limit_error", code="rate_limit_exceeded") from e
        try:
            await group.wait_added()
        except ValueError as e:  # the engine refused it (prompt too long, token id out of range, bad grammar...)
            raise bad_request(str(e), body, prompt_param) from e
        except BaseException:
            group.abort()
            raise
        return group

    def sse(chunks, group: RequestGroup) -> EventStreamResponse:
        async def body():
            try:
                async for chunk in chunks:  # JSON strings
                    yield f"data: {chunk}\n\n"
            except EngineDeadError as e:  # the headers are sent: say why in the stream (OpenAI's clients raise it)
                yield f"data: {json.dumps(error_body(str(e), None, 'server_error', None))}\n\n"
                return
            yield "data: [DONE]\n\n"
        return EventStreamResponse(body(), group)

    async def collect(raw: Request, group: RequestGroup) -> list | None:
        """The final RequestOutput of each prompt, or None when the client left before the end."""
        async with abort_on_disconnect(raw, group):
            async for _ in group.deltas():
                pass
        return None if group.aborted else group.results()

    router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @router.get("/models")
    async def list_models():
        return ModelList(data=[ModelCard(id=model_name, root=model_root, max_model_len=max_model_len)])

    @router.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        check_request(body)
        # echo with max_tokens=0 returns the prompt alone (lm-eval's loglikelihood): one token is made, unused
        echo_only = body.echo and body.max_tokens == 0
        if echo_only:
            body.max_tokens = 1
        # echo with logprobs scores the prompt too (its tokens' logprobs, from the prefill)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = sampling_params(body, 16, body.logprobs, prompt_logprobs)  # OpenAI's default max_tokens is 16
        prompts = body.prompt_list()
        if not prompts:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if body.max_tokens is not None and tokenizer is not None:  # tokenized once, here, to check the length
            prompts = [{"prompt": p, "prompt_token_ids": tokenizer.encode(p)} if isinstance(p, str) else p
                       for p in prompts]
            check_context([p["prompt_token_ids"] for p in prompts], body.max_tokens, "max_tokens", "prompt")
        group = await submit(prompts, params, body, "prompt")
        writer = responses.CompletionWriter(random_id("cmpl"), model_name, body.n, body.logprobs, tokenizer,
                                            echo=body.echo, echo_only=echo_only)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return sse(writer.stream(group, usage), group)
        final = await collect(raw, group)
        return Response(status_code=499) if final is None else writer.response(final)

    @router.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        check_request(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        try:
            prompt_ids = responses.apply_chat_template(tokenizer, body, chat_template)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from e
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        check_context([prompt_ids], body.max_tokens, "max_tokens", "messages")
        # Without max_tokens a chat reply may use the rest of the context (vLLM's default).
        params = sampling_params(body, max(1, max_model_len - len(prompt_ids)), body.engine_logprobs())
        group = await submit([{"prompt_token_ids": prompt_ids}], params, body, "messages")
        writer = responses.ChatWriter(random_id("chatcmpl"), model_name, body.n, body.top_logprobs or 0,
                                      tokenizer)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return sse(writer.stream(group, usage), group)
        final = await collect(raw, group)
        return Response(status_code=499) if final is None else writer.response(final[0])

    app.include_router(router)

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise ApiError(503, f"engine is not running: {engine.error!r}", type_="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        snap = engine.snapshot
        text = engine.metrics.render(
            running=engine.num_in_flight - engine.num_waiting, waiting=engine.num_waiting,
            free_blocks=snap.num_free_blocks, total_blocks=snap.num_total_blocks)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    return app


# ---- command line --------------------------------------------------------------------------------

ENGINE_FLAGS = ("model", "dtype", "device", "block_size", "num_kv_blocks", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "enable_prefix_caching", "attention_backend", "enforce_eager",
                "gpu_memory_utilization", "seed", "num_scheduler_steps", "async_scheduling", "tensor_parallel_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory or hub id (default: the embedded tiny model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 listens on every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 (also FLEXENGINE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests allowed to wait beyond --max-num-seqs; past that the server answers 429")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file for /v1/chat/completions instead of the model's own")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's access and error log level")
    engine = parser.add_argument_group("engine (unset → EngineConfig's default)")
    engine.add_argument("--dtype", default=None, help="weights and KV dtype: auto, float32, bfloat16, float16")
    engine.add_argument("--device", default=None, help="auto (cuda if available), cpu, cuda, cuda:N")
    engine.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV cache page (default: 128 on a GPU with the flex backend, else 16)")
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache pages (default: sized from memory)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output per request (default: the model's context, or what the KV "
                             "cache holds when that is less)")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step (default 256)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step, chunked prefill (default 8192 on a GPU, 2048 on the CPU)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of GPU memory for weights, activations and KV cache (default 0.9)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="share KV pages of common prompt prefixes (default on; off for look-ahead masks)")
    engine.add_argument("--attention-backend", default=None, choices=["flex", "flash", "reference", "auto"],
                        help="attention backend (default: FLEXENGINE_ATTENTION_BACKEND, else auto)")
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="no CUDA graphs, no compiled layers (FlexAttention stays compiled on a GPU)")
    engine.add_argument("--seed", type=int, default=None, help="engine seed for sampling (default 0)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="ranks (GPUs, one process each) the model is sharded over, Megatron-style (default 1)")
    engine.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="decode steps per schedule, fed on the device (CUDA graphs only; default 1)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each step before reading the last one's tokens back, so that output "
                             "processing overlaps the GPU (default: on for a GPU, as vLLM serves since 0.14; "
                             "off on CPU and with --num-scheduler-steps > 1, which it excludes)")


def engine_config_from_args(args: argparse.Namespace):
    from flexengine.config import EngineConfig
    given = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    return EngineConfig(**given)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    api_key = args.api_key or env_api_key()
    if args.max_waiting_requests < 0:
        raise SystemExit("--max-waiting-requests must be >= 0")
    chat_template = read_chat_template(args.chat_template, "serve")  # before the engine starts: fail at once
    config = engine_config_from_args(args)
    log_to_stderr()
    process = EngineProcess.start(config)  # builds (and on a GPU warms up) the engine before we listen
    try:
        engine = AsyncEngine(process, config.max_num_seqs, args.max_waiting_requests)
        model_name = args.served_model_name or args.model or "default"
        app = build_app(engine, model_name, api_key, model_root=args.model, chat_template=chat_template)
        freeze_startup_heap()
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        process.stop()  # already done by the app's shutdown, unless uvicorn never started it
    return 0
