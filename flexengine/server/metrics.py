"""Server metrics through `prometheus_client` (vLLM's choice), in the Prometheus text format.

Metric names follow vLLM's (`vllm:` → `flexengine:`) so existing dashboards carry over. Each server
has a registry of its own (a process may hold several apps, as the tests do); the gauges are read
from the engine when /metrics is scraped.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

PREFIX = "flexengine:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)

disable_created_metrics()  # no `_created` timestamp series (vLLM turns them off too)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests_received = Counter(PREFIX + "request_received", "Requests accepted into the engine.",
                                         registry=r)
        self.requests_rejected = Counter(PREFIX + "request_rejected", "Requests refused at the load limit (429).",
                                         registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished or aborted requests.",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency from arrival to finish.",
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests the engine is running.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a slot.", registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).",
                              registry=r)
        self.free_blocks = Gauge(PREFIX + "num_free_kv_blocks", "Free KV-cache pages.", registry=r)
        self.total_blocks = Gauge(PREFIX + "num_total_kv_blocks", "KV-cache pages in total.", registry=r)

    def observe_finished(self, arrival: float, first_token: float | None, last_token: float | None,
                         prompt_tokens: int, output_tokens: list[int], finish_reason: str) -> None:
        """Record one engine request that finished (or was aborted): its prompt length and each of its
        completions' token count."""
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        num_tokens = max(output_tokens, default=0)
        self.generation_tokens.inc(sum(output_tokens))
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            self.e2e.observe(last_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((last_token - first_token) / (num_tokens - 1))

    def render(self, *, running: int, waiting: int, free_blocks: int, total_blocks: int) -> str:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(1.0 - free_blocks / total_blocks if total_blocks else 0.0)
        self.free_blocks.set(free_blocks)
        self.total_blocks.set(total_blocks)
        return generate_latest(self.registry).decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with labels, as written) → value; for tests and scripts reading /metrics."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
