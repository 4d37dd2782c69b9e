"""`flexengine bench serve`: vLLM's serving benchmark against any OpenAI-compatible server.

Sends a random dataset of fixed-length prompts with Poisson arrivals (or all at once), streams every
response to time TTFT, TPOT and ITL, and prints vLLM's report block. Lengths are fixed with
`ignore_eos` and `max_tokens`, as vLLM's benchmarks do.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import numpy as np

REPORT_WIDTH = 50


@dataclass
class BenchRequest:
    prompt: list[int] | str   # token ids (completions) or text (chat, or completions without ids)
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0          # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--dataset-name", default="random", choices=["random"])
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    parser.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals; inf sends them all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer for prompts of exactly --input-len tokens in its vocabulary; without "
                             "one, prompts are ids below --vocab-size (completions) or one letter per token (chat)")
    parser.add_argument("--vocab-size", type=int, default=256, help="random token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, help="also write the metrics and per-request data here")


# ---- dataset ---------------------------------------------------------------------------------------

def random_requests(args) -> list[BenchRequest]:
    """Random prompts of exactly input_len tokens (with a tokenizer, or as ids), as vLLM's random dataset."""
    rng = random.Random(args.seed)
    chat = args.endpoint.endswith("chat/completions")
    if args.tokenizer is not None:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        special = set(tokenizer.all_special_ids)
        vocab = [t for t in range(len(tokenizer)) if t not in special]
    else:
        tokenizer, vocab = None, list(range(args.vocab_size))
    requests = []
    for _ in range(args.num_prompts):
        if chat and tokenizer is None:
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.input_len))
        else:
            ids = [rng.choice(vocab) for _ in range(args.input_len)]
            prompt = tokenizer.decode(ids) if chat else ids
        requests.append(BenchRequest(prompt, args.input_len, args.output_len))
    return requests


def payload_for(req: BenchRequest, model: str, chat: bool) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


# ---- client ----------------------------------------------------------------------------------------

def is_token_chunk(choice: dict) -> bool:
    """A streamed choice that carries generated output (chat's opening role-only chunk does not)."""
    if "delta" in choice:
        return choice["delta"].get("role") is None or bool(choice["delta"].get("content"))
    return True


@dataclass
class Endpoint:
    host: str
    port: int
    path: str
    tls: bool


def parse_endpoint(url: str) -> Endpoint:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SystemExit(f"--base-url must be http:// or https://host[:port], got {url!r}")
    tls = parts.scheme == "https"
    return Endpoint(parts.hostname, parts.port or (443 if tls else 80), parts.path or "/", tls)


def request_bytes(ep: Endpoint, headers: dict, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    lines = [f"POST {ep.path} HTTP/1.1", f"Host: {ep.host}:{ep.port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """(status, lower-cased headers) of an HTTP/1.1 response."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
    return status, {k.strip().lower(): v.strip() for k, v in headers.items()}


async def body_parts(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The response body as it arrives: chunked, sized, or up to the end of the connection."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            yield (await reader.readexactly(size + 2))[:-2]
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def sse_data(parts):
    """The `data:` payload of each server-sent event, as bytes, as soon as its event is complete."""
    buffer = b""
    async for part in parts:
        buffer += part
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()


async def send_request(ep: Endpoint, headers: dict, payload: dict, prompt_len: int) -> RequestResult:
    """One streamed request over its own connection. A plain asyncio client: the benchmark must absorb
    every token of a fast server, and httpx's per-chunk cost made the client the bottleneck."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    num_chunks = 0
    reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=True if ep.tls else None,
                                                   limit=1 << 20)
    try:
        writer.write(request_bytes(ep, headers, payload))
        status, response_headers = await read_head(reader)
        parts = body_parts(reader, response_headers)
        if status != 200:
            body = b"".join([part async for part in parts])
            result.error = f"HTTP {status}: {body.decode(errors='replace')[:500]}"
            return result
        async for data in sse_data(parts):
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
                result.prompt_len = chunk["usage"]["prompt_tokens"] or prompt_len
            choices = chunk.get("choices") or []
            if choices and is_token_chunk(choices[0]):
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
    finally:
        writer.close()
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or num_chunks
    result.success = num_chunks > 0
    if not result.success:
        result.error = "stream ended without output"
    return result


async def arrivals(count: int, rate: float, rng: random.Random):
    """Yield request indices spaced by exponential gaps (a Poisson process); all at once when rate is inf."""
    for i in range(count):
        yield i
        if rate != float("inf") and i + 1 < count:
            await asyncio.sleep(rng.expovariate(rate))


def served_model(base: str, headers: dict) -> str:
    import httpx
    listed = httpx.get(base + "/v1/models", headers=headers, trust_env=False, timeout=60)
    listed.raise_for_status()
    return listed.json()["data"][0]["id"]


async def run_benchmark(args) -> dict:
    base = args.base_url.rstrip("/")
    ep = parse_endpoint(base + args.endpoint)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chat = args.endpoint.endswith("chat/completions")
    requests = random_requests(args)
    model = args.model or served_model(base, headers)
    print(f"Starting initial single prompt test run against {base}{args.endpoint} (model {model})...")
    probe = await send_request(ep, headers, payload_for(requests[0], model, chat), requests[0].prompt_len)
    if not probe.success:
        raise SystemExit(f"initial test run failed: {probe.error}")
    print(f"Initial test run completed. Starting main benchmark run: {args.num_prompts} prompts, "
          f"request rate {args.request_rate}, max concurrency {args.max_concurrency}")

    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def send(req: BenchRequest) -> RequestResult:
        try:
            return await send_request(ep, headers, payload_for(req, model, chat), req.prompt_len)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            # A refused or broken connection, a malformed response: a failed request, printed, as vLLM does.
            return RequestResult(prompt_len=req.prompt_len, error=f"{type(e).__name__}: {e}")

    async def one(req: BenchRequest) -> RequestResult:
        if semaphore is None:
            return await send(req)
        async with semaphore:
            return await send(req)

    start = time.perf_counter()
    tasks = []
    async for i in arrivals(len(requests), args.request_rate, random.Random(args.seed + 1)):
        tasks.append(asyncio.create_task(one(requests[i])))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return summarize(results, duration, args)


# ---- report ----------------------------------------------------------------------------------------

def _stats_ms(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0
    ms = np.asarray(values) * 1000
    return float(np.mean(ms)), float(np.median(ms)), float(np.percentile(ms, 99))


def summarize(results: list[RequestResult], duration: float, args) -> dict:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots),
                         ("itl", [x for r in ok for x in r.itl])):
        metrics[f"mean_{name}_ms"], metrics[f"median_{name}_ms"], metrics[f"p99_{name}_ms"] = _stats_ms(values)
    metrics["errors"] = [r.error for r in results if not r.success]
    metrics["requests"] = [asdict(r) for r in results]
    return metrics


def format_report(m: dict) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=REPORT_WIDTH, c="=")]

    def row(label, value, fmt=""):
        lines.append("{:<40} {:<10{}}".format(label, value, fmt))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m["max_concurrency"] is not None:
        row("Maximum request concurrency:", m["max_concurrency"])
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for title, key, label in (("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-token Latency", "itl", "ITL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=REPORT_WIDTH, c="-"))
        row(f"Mean {label} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {label} (ms):", m[f"median_{key}_ms"], ".2f")
        row(f"P99 {label} (ms):", m[f"p99_{key}_ms"], ".2f")
    lines.append("=" * REPORT_WIDTH)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        raise SystemExit("--request-rate must be > 0 (inf sends everything at once)")
    metrics = asyncio.run(run_benchmark(args))
    for error in metrics["errors"][:5]:
        print(f"request failed: {error}")
    print(format_report(metrics))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(metrics, f, indent=2)
    return 0 if metrics["completed"] else 1
