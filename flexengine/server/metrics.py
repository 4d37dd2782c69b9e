"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Metric names follow vLLM's (`vllm:` → `flexengine:`) so existing dashboards carry over. All updates
happen on the event loop thread, so plain Python numbers suffice.
"""
from __future__ import annotations

import bisect
import math

PREFIX = "flexengine:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in pairs.items())
    return "{" + ",".join(escaped) + "}"


class Counter:
    def __init__(self, name: str, help_text: str):
        self.name, self.help = PREFIX + name, help_text
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1, **labels) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()) or [((), 0)]:
            lines.append(f"{self.name}{_labels(dict(key))} {_number(value)}")
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help = PREFIX + name, help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(float(bound))}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_number(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def render_gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {_number(value)}"]


class ServerMetrics:
    def __init__(self):
        self.requests_received = Counter("request_received_total", "Requests accepted into the engine.")
        self.requests_rejected = Counter("request_rejected_total", "Requests refused at the load limit (429).")
        self.request_success = Counter("request_success_total", "Finished requests, by finish reason.")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of finished or aborted requests.")
        self.generation_tokens = Counter("generation_tokens_total", "Generated tokens.")
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency from arrival to finish.",
                             E2E_BUCKETS)

    def observe_finished(self, arrival: float, first_token: float | None, last_token: float | None,
                         prompt_tokens: int, output_tokens: list[int], finish_reason: str) -> None:
        """Record one engine request that finished (or was aborted): its prompt length and each of its
        completions' token count."""
        self.request_success.inc(finished_reason=finish_reason)
        self.prompt_tokens.inc(prompt_tokens)
        num_tokens = max(output_tokens, default=0)
        self.generation_tokens.inc(sum(output_tokens))
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            self.e2e.observe(last_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((last_token - first_token) / (num_tokens - 1))

    def render(self, *, running: int, waiting: int, free_blocks: int, total_blocks: int) -> str:
        usage = 1.0 - free_blocks / total_blocks if total_blocks else 0.0
        lines = []
        lines += render_gauge("num_requests_running", "Requests the engine is running.", running)
        lines += render_gauge("num_requests_waiting", "Requests waiting for a slot.", waiting)
        lines += render_gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).", usage)
        lines += render_gauge("num_free_kv_blocks", "Free KV-cache pages.", free_blocks)
        lines += render_gauge("num_total_kv_blocks", "KV-cache pages in total.", total_blocks)
        for metric in (self.requests_received, self.requests_rejected, self.request_success,
                       self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            lines += metric.render()
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with labels, as written) → value; for tests and scripts reading /metrics."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
