"""The OpenAI-compatible server, end to end: real `flexengine serve` processes on loopback ports, driven
by the official `openai` client (and raw httpx where a malformed body must reach the server)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flexengine.server.metrics import parse_metrics  # noqa: E402

API_KEY = "sk-flexengine-test"
ENV_API_KEY = "sk-from-env"
MODEL = "default"
MAX_TOKENS = 8
# The reference backend: these tests are about serving, and on CPU it is ~10x faster than eager flex.
ENGINE_ARGS = ("--attention-backend", "reference", "--seed", "0")
PROMPTS = [f"The number {i} is" + " very" * (i % 7) for i in range(32)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(*args: str, env: dict | None = None):
    """Start `flexengine serve` on a free loopback port; returns (process, base_url, log file)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="flexengine-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "flexengine.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, f"http://127.0.0.1:{port}", log


def wait_ready(proc, base_url: str, log, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    log.seek(0)
    pytest.fail(f"server not ready after {timeout}s:\n{log.read()}")


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metrics(base_url: str) -> dict[str, float]:
    response = httpx.get(base_url + "/metrics")
    assert response.status_code == 200
    return parse_metrics(response.text)


def wait_idle(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request is in flight and the engine holds no page. The page counts come from the
    engine's last step message, which lags the API's request counts: right after a client closes a
    stream, the API already shows 0 running while the engine has not yet freed its pages (8 of 100
    reads on the CPU VM; a test that took those counts as idle waited forever for them to return)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(base_url)
        if (m["flexengine:num_requests_running"] == 0 and m["flexengine:num_requests_waiting"] == 0
                and m["flexengine:num_free_kv_blocks"] == m["flexengine:num_total_kv_blocks"]):
            return m
        time.sleep(0.05)
    pytest.fail("server did not become idle")


@pytest.fixture(scope="module")
def offline_llm():
    # Built first: it also builds the embedded default model, so the servers find it ready.
    from flexengine import LLM
    return LLM(seed=0, attention_backend="reference")


@pytest.fixture(scope="module")
def servers(offline_llm):
    """The main server (--api-key, async scheduling: the tests compare it with the offline engine, which has
    none) and a tiny-limit one (key from FLEXENGINE_API_KEY), started together."""
    main = launch_server("--api-key", API_KEY, "--async-scheduling", *ENGINE_ARGS)
    limited = launch_server("--max-num-seqs", "1", "--max-waiting-requests", "1", *ENGINE_ARGS,
                            env={"FLEXENGINE_API_KEY": ENV_API_KEY})
    try:
        for proc, url, log in (main, limited):
            wait_ready(proc, url, log)
        yield main[1], limited[1]
    finally:
        for proc, _, _ in (main, limited):
            stop_server(proc)


@pytest.fixture(scope="module")
def base_url(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def offline_greedy(llm, prompts, max_tokens=MAX_TOKENS):
    from flexengine import SamplingParams
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0] for o in outputs]


# ---- happy paths ---------------------------------------------------------------------------------

def test_health_and_models(base_url, client):
    assert httpx.get(base_url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_matches_offline(client, offline_llm):
    expected = offline_greedy(offline_llm, [PROMPTS[3]])[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.prompt_tokens > 0


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[5], max_tokens=MAX_TOKENS, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for c in chunks if c.choices]) > 1  # streamed token by token, not all at the end


def test_completion_token_ids_prompt_n_and_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=[[72, 105, 33], [79, 75]], max_tokens=4, n=2,
                                         temperature=1.0, seed=7, logprobs=2,
                                         extra_body={"ignore_eos": True, "top_k": 20})
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == 5 and response.usage.completion_tokens == 16
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == 4 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_completion_echo_with_logprobs_is_lm_eval_loglikelihood(base_url, offline_llm):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1 (and 0), greedy. The
    prompt tokens' logprobs equal the offline engine's prompt_logprobs (another attention backend, the
    reference), the first is null, and the completion follows the prompt."""
    from flexengine import SamplingParams
    ids = [72, 105, 33, 79, 75, 32, 116]
    expected = offline_llm.generate([{"prompt_token_ids": ids}],
                                    SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    prompt_text = offline_llm.get_tokenizer().decode(ids)
    for max_tokens in (1, 0):
        body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
        response = httpx.post(base_url + "/v1/completions", json=body, headers=auth())
        assert response.status_code == 200, response.text
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, len(ids)):
            assert lp["token_logprobs"][pos] == pytest.approx(expected.prompt_logprobs[pos][ids[pos]].logprob, abs=1e-3)
            assert 1 <= len(lp["top_logprobs"][pos]) <= 2
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        completion = expected.outputs[0].text if max_tokens else ""
        assert choice["text"] == prompt_text + completion
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == max_tokens
    # Streamed: the first chunk starts with the prompt and its logprobs; the whole equals the response.
    chunks = []
    with httpx.stream("POST", base_url + "/v1/completions", headers=auth(),
                      json={**body, "max_tokens": 3, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):])["choices"][0])
    whole = httpx.post(base_url + "/v1/completions", headers=auth(), json={**body, "max_tokens": 3}).json()
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    assert sum((c["logprobs"]["token_logprobs"] for c in chunks), []) == whole["choices"][0]["logprobs"]["token_logprobs"]
    # A text prompt, echo alone: the prompt comes back as it was sent, and no logprobs.
    response = httpx.post(base_url + "/v1/completions", headers=auth(),
                          json={"prompt": PROMPTS[2], "echo": True, "max_tokens": 0})
    choice = response.json()["choices"][0]
    assert choice["text"] == PROMPTS[2] and choice["logprobs"] is None and choice["finish_reason"] == "length"


def test_completion_penalties_and_bias_match_offline(client, offline_llm):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias, vLLM's repetition_penalty and
    min_tokens: the server's greedy text equals the offline engine's with the same SamplingParams."""
    from flexengine import SamplingParams
    fields = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3, min_tokens=4)
    expected = offline_llm.generate([PROMPTS[7]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                  logit_bias={101: 2.5}, **fields), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=MAX_TOKENS, temperature=0,
                                         presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"101": 2.5},
                                         extra_body={"repetition_penalty": 1.3, "min_tokens": 4})
    assert response.choices[0].text == expected.outputs[0].text
    plain = offline_greedy(offline_llm, [PROMPTS[7]])[0]
    assert expected.outputs[0].token_ids != plain.token_ids  # the fields changed something


def test_chat_completion_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    # The chat template wraps the messages, so the prompt is longer than their text.
    assert whole.usage.prompt_tokens > len("be brief") + len("hello there")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_32_concurrent_requests_match_offline(base_url, offline_llm):
    expected = offline_greedy(offline_llm, PROMPTS)

    async def run():
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*[
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                for p in PROMPTS])

    responses = asyncio.run(run())
    assert [r.choices[0].text for r in responses] == [e.text for e in expected]
    assert [r.usage.completion_tokens for r in responses] == [len(e.token_ids) for e in expected]


# ---- continuous batching, disconnects ------------------------------------------------------------

def test_new_request_joins_running_batch(base_url, client):
    wait_idle(base_url)
    long = client.completions.create(model=MODEL, prompt="long", max_tokens=400, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(long))  # the long request is running
    short = client.completions.create(model=MODEL, prompt="short", max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 2
    # Had the server run requests one after another, the long one would be over by now.
    assert metrics(base_url)["flexengine:num_requests_running"] == 1
    long.close()
    wait_idle(base_url)


def test_client_disconnect_frees_pages(base_url):
    idle = wait_idle(base_url)
    idle_free = idle["flexengine:num_free_kv_blocks"]
    aborted_before = idle.get('flexengine:request_success_total{finished_reason="abort"}', 0)
    generated_before = idle["flexengine:generation_tokens_total"]
    own = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0)
    stream = own.completions.create(model=MODEL, prompt="x" * 40, max_tokens=400, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metrics(base_url)["flexengine:num_free_kv_blocks"] < idle_free  # the request holds pages
    stream.close()
    own.close()
    deadline = time.monotonic() + 10
    while metrics(base_url)["flexengine:num_free_kv_blocks"] != idle_free:
        assert time.monotonic() < deadline, "pages not freed after the client disconnected"
        time.sleep(0.02)
    after = metrics(base_url)
    assert after.get('flexengine:request_success_total{finished_reason="abort"}', 0) == aborted_before + 1
    assert after["flexengine:generation_tokens_total"] - generated_before < 400  # stopped early


def test_metrics_are_prometheus_text_with_vllms_families(base_url, client):
    """/metrics parses with Prometheus' own text parser; a finished request shows in vLLM's families."""
    from prometheus_client.parser import text_string_to_metric_families
    wait_idle(base_url)
    client.completions.create(model=MODEL, prompt="count", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    wait_idle(base_url)
    response = httpx.get(base_url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    kinds = {name: f.type for name, f in families.items()}
    assert kinds["flexengine:request_success"] == "counter" and kinds["flexengine:generation_tokens"] == "counter"
    assert kinds["flexengine:time_to_first_token_seconds"] == "histogram"
    assert kinds["flexengine:num_free_kv_blocks"] == "gauge"
    ttft = {s.name: s.value for s in families["flexengine:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")}
    assert ttft["flexengine:time_to_first_token_seconds_count"] >= 1
    stops = [s for s in families["flexengine:request_success"].samples if s.labels.get("finished_reason") == "length"]
    assert stops and stops[0].value >= 1


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', None),            # malformed JSON
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens"),  # wrong type
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
    ("/v1/completions", b'{"prompt": 5}', "prompt"),
    ("/v1/completions", b'{"max_tokens": 5}', "prompt"),                       # missing field
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', "top_p"),
    ("/v1/completions", b'{"prompt": [1000000]}', "prompt"),                    # the engine refuses these
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [1000000]}', "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"1000000": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 3}', "presence_penalty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": '
                             b'{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}',
     "response_format"),                                                        # the engine's compile refuses it
    ("/v1/completions", b'{"prompt": "hi", "structured_outputs": {"regex": "a("}}', "structured_outputs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": []}', "tools"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
     "top_logprobs"),
])
def test_invalid_request_is_400(base_url, path, body, param):
    response = httpx.post(base_url + path, content=body, headers={**auth(), "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]


def test_too_long_prompt_is_400(base_url, client):
    max_model_len = client.models.list().data[0].max_model_len
    too_long = "a" * (max_model_len + 10)
    for path, body, param in (("/v1/completions", {"prompt": too_long}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]},
                               "messages")):
        response = httpx.post(base_url + path, json={"model": MODEL, "max_tokens": 4, **body}, headers=auth())
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["param"] == param
    assert httpx.get(base_url + "/health").status_code == 200  # still serving


def test_max_tokens_past_the_context_is_400_naming_both_numbers(base_url, client):
    """vLLM's answer, not a request that runs until the context is full; the server keeps serving."""
    max_model_len = client.models.list().data[0].max_model_len
    for path, body in (("/v1/completions", {"prompt": "hello"}),
                       ("/v1/completions", {"prompt": [1, 2, 3]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})):
        response = httpx.post(base_url + path, json={"model": MODEL, "max_tokens": max_model_len, **body},
                              headers=auth())
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
        assert f"maximum context length is {max_model_len} tokens" in error["message"]
        assert f"{max_model_len} in the completion" in error["message"], error["message"]
    ok = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=max_model_len - 3, temperature=0,
                                   extra_body={"stop_token_ids": list(range(259))})  # fits exactly; stops at once
    assert ok.choices[0].finish_reason == "stop"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


def test_api_key_required(base_url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(base_url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base_url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(base_url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(base_url + "/metrics").status_code == 200


def test_load_limit_answers_429(servers):
    limited = servers[1]
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    assert httpx.post(limited + "/v1/completions", json=body).status_code == 401  # key from the env var
    headers = {"Authorization": f"Bearer {ENV_API_KEY}"}

    async def burst():
        async with httpx.AsyncClient(base_url=limited, headers=headers, timeout=120) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(8)])

    statuses = [r.status_code for r in asyncio.run(burst())]
    # One running + one waiting fit; the rest arrive while those two are still generating.
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    assert set(statuses) == {200, 429}, statuses
    rejected = metrics(limited)["flexengine:request_rejected_total"]
    assert rejected == statuses.count(429)
    ok = httpx.post(limited + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200  # the limit is about load, not a broken server


# ---- stream chunks without a server: the fast serializer and coalesced outputs ---------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flexengine.outputs import Logprob  # noqa: E402
from flexengine.server import protocol, responses  # noqa: E402
from flexengine.server.async_engine import RequestGroup, RequestState  # noqa: E402
from flexengine.outputs import CompletionDelta  # noqa: E402

REASONS = st.sampled_from([None, "stop", "length", "abort"])


@settings(max_examples=300, deadline=None)
@given(request_id=st.text(), model=st.text(), index=st.integers(0, 1 << 20), text=st.text(), reason=REASONS)
def test_text_chunks_are_the_pydantic_models_json(request_id, model, index, text, reason):
    """The per-token template is byte for byte what the response models write (any unicode, quotes,
    control characters, in the id and model name too)."""
    completion = responses.CompletionWriter(request_id, model, 1, None, None)
    expected = protocol.CompletionResponse(
        id=request_id, created=completion.created, model=model,
        choices=[protocol.CompletionChoice(index=index, text=text, finish_reason=reason)])
    assert completion.text_chunk(index, text, reason) == expected.model_dump_json()
    chat = responses.ChatWriter(request_id, model, 1, 0, None)
    expected = protocol.ChatCompletionChunk(
        id=request_id, created=chat.created, model=model,
        choices=[protocol.ChatStreamChoice(index=index, delta=protocol.DeltaMessage(content=text),
                                           finish_reason=reason)])
    assert chat.text_chunk(index, text, reason) == expected.model_dump_json()


def step_rows(rid: str, texts: list[str], reason: str, logprobs: bool) -> list[CompletionDelta]:
    """What the engine process sends for one request, one token (and its text) per step."""
    rows = []
    for step, text in enumerate(texts):
        token = 100 + step
        lps = [{token: Logprob(-0.5, 1, f"<{token}>")}] if logprobs else None
        rows.append(CompletionDelta(rid, 0, text, [token], lps, None, reason if step == len(texts) - 1 else None,
                                    None, 0))
    return rows


async def stream_chunks(writer, rows: list[CompletionDelta], batches: list[int]) -> list[dict]:
    """Stream `rows` through a RequestGroup, delivering `batches[i]` of them at a time (the handler
    merges what waits in its queue); the parsed chunks."""
    import json
    group = RequestGroup(None, [RequestState.new("r", 0.0, 1, rows[0].logprobs is not None)])
    group.states[0].prompt_token_ids = [1, 2]
    chunks = []

    async def produce():
        i = 0
        for size in batches:
            for row in rows[i:i + size]:
                group.deliver(row)
            i += size
            await asyncio.sleep(0)
        for row in rows[i:]:
            group.deliver(row)

    producer = asyncio.create_task(produce())
    async for chunk in writer.stream(group, include_usage=True):
        chunks.append(json.loads(chunk))
    await producer
    return chunks


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.text(max_size=3), min_size=1, max_size=12), reason=st.sampled_from(["stop", "length"]),
       batches=st.lists(st.integers(1, 5), max_size=12), chat=st.booleans(), logprobs=st.booleans(),
       empty_at=st.lists(st.integers(0, 12), max_size=3))
def test_coalesced_deltas_add_up_to_the_token_by_token_stream(texts, reason, batches, chat, logprobs, empty_at):
    """Rows that queue up are sent as one delta: the text, the logprob tokens, the finish reason and
    the usage chunk (last) are those of the stream sent one row at a time. Rows that say nothing (a
    prefill chunk's, or a finished completion's repeated while others run) send nothing."""
    outputs = step_rows("r", texts, reason, logprobs)
    for at in sorted(empty_at, reverse=True):
        outputs.insert(min(at, len(outputs) - 1), outputs[0]._replace(text="", token_ids=[], finish_reason=None,
                                                                      logprobs=[] if logprobs else None))
    outputs.append(outputs[-1]._replace(text="", token_ids=[], logprobs=[] if logprobs else None))  # a repeat

    def writer():
        if chat:
            return responses.ChatWriter("chatcmpl-x", "m", 1, 1, None)
        return responses.CompletionWriter("cmpl-x", "m", 1, 1 if logprobs else None, None)

    one_by_one = asyncio.run(stream_chunks(writer(), outputs, [1] * len(outputs)))
    coalesced = asyncio.run(stream_chunks(writer(), outputs, batches))

    def summary(chunks):
        body = [c["choices"][0] for c in chunks if c["choices"]]
        if chat:
            body = body[1:]  # the role chunk
            text = "".join(c["delta"]["content"] for c in body)
            tokens = [t["token"] for c in body if c["logprobs"] for t in c["logprobs"]["content"]]
        else:
            text = "".join(c["text"] for c in body)
            tokens = [t for c in body if c["logprobs"] for t in c["logprobs"]["tokens"]]
        usage = {k: v for k, v in chunks[-1].items() if k != "created"}  # the two runs may straddle a second
        return text, tokens, body[-1]["finish_reason"], usage

    text, tokens, finish, usage = summary(coalesced)
    assert (text, tokens, finish, usage) == summary(one_by_one)
    assert text == "".join(texts) and finish == reason
    assert len(tokens) == (len(texts) if logprobs else 0)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(texts)
    assert [c["finish_reason"] for c in (c["choices"][0] for c in coalesced[:-1] if c["choices"])].count(reason) == 1
    assert len(coalesced) <= len(one_by_one)


def test_serve_chat_template_replaces_the_models_own(tmp_path):
    import argparse

    from flexengine.chat import read_chat_template
    from flexengine.server.api_server import add_arguments, main
    from flexengine.server.protocol import ChatCompletionRequest
    from flexengine.tokenizer import build_byte_tokenizer
    tok = build_byte_tokenizer()
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hey"}], model=MODEL)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    ids = responses.apply_chat_template(tok, body, read_chat_template(str(template), "serve"))
    assert tok.decode(ids) == "[user]hey"
    assert tok.decode(responses.apply_chat_template(tok, body)) != "[user]hey"  # the model's own otherwise
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="cannot read --chat-template"):  # before any engine starts
        main(parser.parse_args(["--chat-template", str(tmp_path / "missing.jinja")]))


def test_queued_outputs_are_coalesced():
    outputs = step_rows("r", ["a", "b", "c", "d"], "length", False)
    chunks = asyncio.run(stream_chunks(responses.CompletionWriter("cmpl-x", "m", 1, None, None), outputs, [3]))
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["abc", "d"]


def test_requests_wait_for_a_full_engine_pipe_without_blocking_the_event_loop():
    """The API side writes the engine's input pipe without blocking: what a full pipe does not take
    waits, and goes once the engine process reads (the event loop watches the fd). Every request
    arrives, whole and in order."""
    import os
    import threading
    from types import SimpleNamespace

    from flexengine.sampling_params import SamplingParams
    from flexengine.server.async_engine import AsyncEngine
    from flexengine.server.engine_process import EngineProcess, EngineSnapshot
    from flexengine.server.pipe import MessageReader, MessageWriter

    to_engine, api_end = os.pipe()
    from_engine, engine_end = os.pipe()
    process = SimpleNamespace(ready=SimpleNamespace(tokenizer=None, max_model_len=1 << 20, snapshot=EngineSnapshot()),
                              writer=MessageWriter(api_end), reader=MessageReader(from_engine),
                              inputs=SimpleNamespace(closed=False), is_alive=lambda: True)
    process.send = lambda message: EngineProcess.send(process, message)
    process.flush = lambda: EngineProcess.flush(process)
    engine = AsyncEngine(process, max_num_seqs=1000, max_waiting_requests=0)
    prompts = [{"prompt_token_ids": list(range(i, i + 5000))} for i in range(40)]  # ~1 MB: many pipe-fulls
    engine_reads = threading.Event()
    got = []

    def engine_process():
        reader = MessageReader(to_engine)
        engine_reads.wait()
        while len(got) < len(prompts):
            reader.wait(5.0)
            got.extend(new for message in reader.read_available() for new in message.new)

    async def api():
        engine.start()
        for i, prompt in enumerate(prompts):  # one message per turn of the event loop
            engine.add_requests([prompt], SamplingParams(max_tokens=1))
            await asyncio.sleep(0)
        assert process.writer.buffer  # the pipe is full: the rest waits, and the loop went on
        engine_reads.set()
        for _ in range(1000):  # the event loop flushes as the pipe drains
            if not process.writer.buffer:
                break
            await asyncio.sleep(0.01)
        engine._stop_reading()
        assert not process.writer.buffer, "what the full pipe did not take was never written"

    reader = threading.Thread(target=engine_process)
    reader.start()
    asyncio.run(api())
    reader.join(10)
    assert [new.prompt for new in got] == prompts
    for fd in (to_engine, api_end, from_engine, engine_end):
        os.close(fd)


def test_serve_turns_async_scheduling_on_for_a_gpu_by_default():
    """`flexengine serve` leaves async scheduling to the engine (on for a GPU) unless told otherwise."""
    import argparse

    from flexengine.server.api_server import add_arguments, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).async_scheduling is None
    assert engine_config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_config_from_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert engine_config_from_args(parser.parse_args(["--num-scheduler-steps", "8"])).num_scheduler_steps == 8
