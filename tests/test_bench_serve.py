"""`flexengine bench serve` against a real `flexengine serve` on loopback: the report is complete and
its numbers add up (fixed lengths through ignore_eos and max_tokens)."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from flexengine import cli  # noqa: E402
from test_server import ENGINE_ARGS, launch_server, stop_server, wait_ready  # noqa: E402

API_KEY = "sk-bench"
REPORT_LABELS = [
    "Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
    "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):",
]


@pytest.fixture(scope="module")
def server():
    proc, url, log = launch_server("--api-key", API_KEY, *ENGINE_ARGS)
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        stop_server(proc)


def parse_report(out: str) -> dict[str, float]:
    assert "============ Serving Benchmark Result ============" in out
    assert out.rstrip().endswith("=" * 50)
    values = {}
    for label in REPORT_LABELS:
        match = re.search(re.escape(label) + r"\s+(\S+)", out)
        assert match, f"report line missing: {label}\n{out}"
        values[label] = float(match.group(1))
    return values


def run_bench(capsys, *args: str) -> dict[str, float]:
    assert cli.main(["bench", "serve", *args]) == 0
    return parse_report(capsys.readouterr().out)


def test_bench_serve_report_all_at_once(server, capsys, tmp_path):
    json_out = tmp_path / "bench.json"
    report = run_bench(capsys, "--base-url", server, "--api-key", API_KEY, "--num-prompts", "8",
                       "--input-len", "24", "--output-len", "6", "--json-out", str(json_out))
    assert report["Successful requests:"] == 8 and report["Failed requests:"] == 0
    assert report["Total input tokens:"] == 8 * 24
    assert report["Total generated tokens:"] == 8 * 6   # ignore_eos + max_tokens fix the length
    assert report["Benchmark duration (s):"] > 0
    for key in ("TTFT", "TPOT", "ITL"):
        assert 0 < report[f"Mean {key} (ms):"] and report[f"Median {key} (ms):"] <= report[f"P99 {key} (ms):"]
    saved = json.loads(json_out.read_text())
    assert saved["completed"] == 8 and len(saved["requests"]) == 8
    assert saved["request_throughput"] == pytest.approx(8 / saved["duration"])
    assert report["Request throughput (req/s):"] == pytest.approx(saved["request_throughput"], abs=0.01)
    assert report["Mean TTFT (ms):"] == pytest.approx(saved["mean_ttft_ms"], abs=0.01)
    # One chunk per generated token, or fewer where the server merged tokens that queued up for a request.
    assert all(1 <= len(r["itl"]) <= 5 for r in saved["requests"])


def test_bench_serve_poisson_chat_with_concurrency_cap(server, capsys):
    report = run_bench(capsys, "--base-url", server, "--api-key", API_KEY, "--endpoint", "/v1/chat/completions",
                       "--num-prompts", "6", "--input-len", "16", "--output-len", "4", "--request-rate", "20",
                       "--max-concurrency", "2", "--seed", "3")
    assert report["Successful requests:"] == 6
    assert report["Total generated tokens:"] == 6 * 4


def test_bench_serve_counts_failures(server, capsys):
    # A wrong key: the initial probe fails and the benchmark stops with the server's error.
    with pytest.raises(SystemExit, match="401"):
        cli.main(["bench", "serve", "--base-url", server, "--api-key", "wrong", "--model", "default",
                  "--num-prompts", "2", "--input-len", "4", "--output-len", "2"])


# ---- the client's own HTTP/SSE parsing --------------------------------------------------------------

import asyncio  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flexengine.benchmarks.serve import body_parts, read_head, sse_data  # noqa: E402


async def parse_response(raw: bytes, cuts: list[int]) -> tuple[int, list[bytes]]:
    """Feed `raw` to a StreamReader in pieces cut at `cuts`; (status, SSE data payloads)."""
    reader = asyncio.StreamReader()

    async def feed():
        start = 0
        for cut in sorted(set(cuts)) + [len(raw)]:
            reader.feed_data(raw[start:cut])
            start = cut
            await asyncio.sleep(0)
        reader.feed_eof()

    feeder = asyncio.create_task(feed())
    status, headers = await read_head(reader)
    data = [d async for d in sse_data(body_parts(reader, headers))]
    await feeder
    return status, data


LINE = st.text(st.characters(codec="utf-8", blacklist_characters="\n\r"), max_size=40).map(str.encode)


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(LINE, min_size=1, max_size=8),
       frames=st.lists(st.integers(1, 4), min_size=1, max_size=8), chunked=st.booleans(),
       cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_sse_parsing_survives_any_framing(payloads, frames, chunked, cuts):
    """Events split over HTTP chunks and TCP reads however they fall come out whole, in order."""
    body = b"".join(b"data: " + p + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    if chunked:  # cut the body into HTTP chunks of `frames` sizes (cycled)
        pieces, i, k = [], 0, 0
        while i < len(body):
            size = frames[k % len(frames)] * 7
            pieces.append(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]))
            i, k = i + size, k + 1
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        raw = head + b"".join(pieces) + b"0\r\n\r\n"
    else:
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    status, data = asyncio.run(parse_response(raw, [c for c in cuts if c < len(raw)]))
    assert status == 200
    assert data == [p.strip() for p in payloads] + [b"[DONE]"]
