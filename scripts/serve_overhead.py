"""The server's own overhead, on CPU: offline engine vs `flexengine serve` + `flexengine bench serve`,
on the same workload in the same run, with the model step made near-free.

    python scripts/serve_overhead.py                      # 256 prompts x 256 in x 256 out, rate inf
    python scripts/serve_overhead.py --request-rate 16    # TPOT at a fixed rate
    python scripts/serve_overhead.py --client-only        # the bench client's own capacity

The model step is replaced by a sleep of --step-ms + --step-us-per-seq x batch + --step-us-per-token x
prompt tokens (the GIL is released while sleeping, as it is while a GPU step runs), in the offline
engine and in the server's engine process alike (FAKE_STEP_ENV below), returning printable random
tokens: what is left is the host work of scheduling, output building, detokenizing and, for the
server, HTTP streaming. The defaults (2 ms + 25 us/seq, 8.4 ms at 256 sequences) mimic the
Llama-3.2-1B decode step on an H100; --step-us-per-token charges prompt tokens too. --server-log keeps the
server's log (with FLEXENGINE_STATS_INTERVAL_S=0.1, a time line of the engine loop).
--real-model runs the embedded tiny model (reference attention) instead. The server and the bench
client run as separate processes, as they do on the GPU box; --client-only measures the client against
a fake server that streams pre-built chunks on the fake step's clock (one chunk per stream per step),
so the offline number is its ceiling too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

VOCAB_LO, VOCAB_HI = 32, 127  # printable ASCII byte tokens of the embedded model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--step-ms", type=float, default=2.0, help="fake step: fixed time per step")
    p.add_argument("--step-us-per-seq", type=float, default=25.0, help="fake step: extra time per sequence")
    p.add_argument("--step-us-per-token", type=float, default=0.0,
                   help="fake step: extra time per prompt token beyond one per sequence (4: 8 ms per "
                        "2,048-token step)")
    p.add_argument("--real-model", action="store_true", help="run the tiny model instead of the fake step")
    p.add_argument("--client-only", action="store_true", help="only the bench client against a fake SSE server")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--server-args", default="", help="extra `flexengine serve` flags")
    p.add_argument("--async-scheduling", action="store_true", help="the offline engine and the server both")
    p.add_argument("--server-log", help="keep the server's log (its engine's stats lines: FLEXENGINE_STATS_INTERVAL_S)")
    p.add_argument("--role", default="main", choices=["main", "server", "fake-sse"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def engine_flags(args) -> dict:
    """Flags shared by the offline engine and the server: room in the KV cache for every request."""
    blocks = args.num_prompts * -(-(args.input_len + args.output_len) // 16) + 64
    flags = dict(attention_backend="reference", seed=0, max_num_seqs=256, num_kv_blocks=blocks)
    return {**flags, "async_scheduling": True} if args.async_scheduling else flags


# ---- the near-free model step ------------------------------------------------------------------------

def fake_model_step(step_ms: float, step_us_per_seq: float, step_us_per_token: float = 0.0) -> None:
    """Replace the model step with a fake device: a step returns at once with random printable tokens,
    which can be read back (InFlightStep.wait sleeps, releasing the GIL) once the device is through
    it. Steps queue on the device one after another, so async scheduling overlaps host and device
    work as on a GPU."""
    from flexengine.engine.in_flight import InFlightStep
    from flexengine.engine.model_runner import ModelRunner
    from flexengine.layers.sampler import SamplerOutput

    gen = torch.Generator().manual_seed(0)
    device = {"free_at": 0.0}  # when the fake device finishes the last step queued
    launch, wait = InFlightStep.launch.__func__, InFlightStep.wait

    def execute(self, batch, prev=None):
        # The sequences whose prompt is complete after this step get a token (as prepare_step picks them).
        seqs = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
        step_s = (step_ms + (step_us_per_seq * len(batch.seqs) + step_us_per_token * (batch.num_tokens - len(batch.seqs))) / 1000) / 1000
        device["free_at"] = max(time.perf_counter(), device["free_at"]) + step_s
        if not seqs:
            return [], None, None
        return seqs, SamplerOutput(token_ids=torch.randint(VOCAB_LO, VOCAB_HI, (len(seqs),), generator=gen)), None

    def launch_fake(cls, *args):
        step = launch(cls, *args)
        step.done_at = device["free_at"]
        return step

    def wait_fake(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return wait(self)

    ModelRunner.execute = execute
    InFlightStep.launch = classmethod(launch_fake)
    InFlightStep.wait = wait_fake


# The server's engine runs in a spawned process, which re-imports this script as __mp_main__ (its
# `if __name__ == "__main__"` part does not run): the server role names the fake step here, in the
# environment the engine process inherits, and the engine process fakes its step on import.
FAKE_STEP_ENV = "SERVE_OVERHEAD_FAKE_STEP"
if __name__ == "__mp_main__" and os.environ.get(FAKE_STEP_ENV):
    fake_model_step(*map(float, os.environ[FAKE_STEP_ENV].split(",")))


# ---- offline ------------------------------------------------------------------------------------------

def run_offline(args) -> tuple[float, float]:
    """Output tokens/s of LLM.generate on the workload (after a small warm-up), and its CPU us per token."""
    from flexengine import LLM
    from flexengine.benchmarks.common import generate_fixed, random_prompts, warm_up

    llm = LLM(**engine_flags(args))
    warm_up(llm, args.input_len, 0)
    prompts = random_prompts(args.num_prompts, args.input_len, 256, 0)
    cpu = time.process_time()
    seconds = generate_fixed(llm, prompts, args.output_len, 0.0)
    tokens = args.num_prompts * args.output_len
    return tokens / seconds, 1e6 * (time.process_time() - cpu) / tokens


# ---- server and client processes ------------------------------------------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(role: str, args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--port", str(port), "--step-ms", str(args.step_ms),
           "--step-us-per-seq", str(args.step_us_per_seq),
           "--step-us-per-token", str(args.step_us_per_token), "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--server-args", args.server_args] + (["--real-model"] if args.real_model else []) + \
        (["--async-scheduling"] if args.async_scheduling else [])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, url: str, log, timeout: float = 120) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server not ready after {timeout}s")


def run_client(args, url: str) -> dict:
    """`flexengine bench serve` as its own process; returns its JSON metrics."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "flexengine.cli", "bench", "serve", "--base-url", url, "--model", "default",
               "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--request-rate", str(args.request_rate),
               "--json-out", out.name]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> dict[str, int]:
    """The server process and its engine process (a spawned child), by role."""
    tree = {"api": pid}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if parent == pid and b"spawn_main" in cmdline:
                tree["engine"] = int(entry)
    return tree


def against(role: str, args) -> dict:
    """The client's metrics against a server of this role, plus each server process's CPU seconds
    during the run (in "cpu_s")."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (open(args.server_log, "w+") if args.server_log and role == "server" else tempfile.TemporaryFile("w+")) as log:
        proc = start(role, args, port, log)
        try:
            wait_ready(proc, url, log)
            tree = process_tree(proc.pid)
            before = {role_: cpu_seconds(pid) for role_, pid in tree.items()}
            metrics = run_client(args, url)
            metrics["cpu_s"] = {role_: cpu_seconds(pid) - before[role_] for role_, pid in tree.items()}
            return metrics
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def serve(args) -> int:
    from flexengine import cli
    if not args.real_model:
        os.environ[FAKE_STEP_ENV] = f"{args.step_ms},{args.step_us_per_seq},{args.step_us_per_token}"  # for the engine process
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
             for k, v in engine_flags(args).items()]
    return cli.main(["serve", "--port", str(args.port), "--uvicorn-log-level", "warning", *flags,
                     *args.server_args.split()])


# ---- a fake SSE server: the client's ceiling ---------------------------------------------------------------

async def fake_sse(args) -> None:
    """Answers /health and streams output_len completion chunks + usage + [DONE] to every POST, one
    chunk per open stream per fake step, all written back to back as the server does."""
    chunk = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "default",
             "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}], "usage": None}
    token = f"data: {json.dumps(chunk)}\n\n".encode()
    usage = dict(chunk, choices=[], usage={"prompt_tokens": args.input_len, "completion_tokens": args.output_len,
                                           "total_tokens": args.input_len + args.output_len})
    tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

    def framed(data: bytes) -> bytes:  # one HTTP/1.1 chunk
        return b"%x\r\n%s\r\n" % (len(data), data)

    streams = 0
    tick = asyncio.get_running_loop().create_future()

    async def ticker() -> None:  # one "engine step" at a time: every open stream gets a chunk
        nonlocal tick
        while True:
            await asyncio.sleep((args.step_ms + args.step_us_per_seq * streams / 1000) / 1000)
            done, tick = tick, asyncio.get_running_loop().create_future()
            done.set_result(None)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal streams
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            streams += 1
            for _ in range(args.output_len):
                await tick
                writer.write(framed(token))
            writer.write(framed(tail) + b"0\r\n\r\n")
            streams -= 1
            await writer.drain()

    asyncio.create_task(ticker())
    server = await asyncio.start_server(handle, "127.0.0.1", args.port, backlog=4096)
    async with server:
        await server.serve_forever()


# ---- report ------------------------------------------------------------------------------------------

def report(args, offline: tuple[float, float] | None, served: dict | None, client: dict | None) -> None:
    mode = "tiny model" if args.real_model else f"fake step {args.step_ms} ms + {args.step_us_per_seq} us/seq + {args.step_us_per_token} us/prompt token"
    print(f"# serve overhead | CPU x{os.cpu_count()} | {mode} | {args.num_prompts} prompts x {args.input_len} in "
          f"x {args.output_len} out | request rate {args.request_rate}")
    if offline is not None:
        print(f"offline engine        {offline[0]:10.0f} output tok/s   CPU {offline[1]:.1f} us per output token")
    if served is not None:
        print(f"server (bench serve)  {served['output_throughput']:10.0f} output tok/s   median TPOT "
              f"{served['median_tpot_ms']:.2f} ms, median TTFT {served['median_ttft_ms']:.0f} ms, "
              f"failed {served['failed']}")
        ttft = sorted(1000 * r["ttft"] for r in served["requests"] if r["success"])
        print(f"                      TTFT first / median / last request {ttft[0]:.0f} / {ttft[len(ttft) // 2]:.0f} / "
              f"{ttft[-1]:.0f} ms")
        chunks = [len(r["itl"]) + 1 for r in served["requests"] if r["success"]]
        print(f"                      {sum(chunks) / len(chunks):10.1f} chunks per request "
              f"(< output len: the server merged tokens that queued up)")
        tokens = served["total_output_tokens"] or 1
        cpu = ", ".join(f"{role} process {1e6 * seconds / tokens:.1f}" for role, seconds in served["cpu_s"].items())
        print(f"CPU us per output token: {cpu} (the initial test request included)")
        if offline is not None:
            print(f"server / offline      {served['output_throughput'] / offline[0]:10.2f}")
    if client is not None:
        print(f"client vs fake SSE server {client['output_throughput']:10.0f} output tok/s   median TPOT "
              f"{client['median_tpot_ms']:.2f} ms (the client's ceiling on this clock)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    if args.role == "server":
        return serve(args)
    if args.role == "fake-sse":
        asyncio.run(fake_sse(args))
        return 0
    if args.client_only:
        report(args, None, None, against("fake-sse", args))
        return 0
    offline = None
    if not args.skip_offline:
        if not args.real_model:
            fake_model_step(args.step_ms, args.step_us_per_seq, args.step_us_per_token)
        offline = run_offline(args)
    report(args, offline, against("server", args), None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
