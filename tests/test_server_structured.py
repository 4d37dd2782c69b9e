"""Structured outputs at the server: response_format (json_object, json_schema) on chat and completions,
vLLM's structured_outputs extra and the older guided_* fields; every answer validates (jsonschema,
re.fullmatch, the choice list), and a bad spec is a 400 naming its field, with the engine still serving."""
from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from test_server import ENGINE_ARGS, launch_server, metrics, stop_server, wait_ready  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 20}},
          "required": ["city", "rank"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON"}]


@pytest.fixture(scope="module")
def base_url():
    proc, url, log = launch_server("--async-scheduling", *ENGINE_ARGS)  # grammar steps read back before launching
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    response = client.chat.completions.create(model="default", messages=MESSAGES, response_format=fmt, n=3,
                                              temperature=1.0, seed=5, max_tokens=200)
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completion_json_object_and_schema_streamed(client):
    out = client.completions.create(model="default", prompt="JSON:", max_tokens=300, temperature=1.0, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), (dict, list))
    else:  # the builtin JSON grammar lets a random model nest on
        assert choice.finish_reason == "length" and choice.text[0] in "[{"
    stream = client.completions.create(
        model="default", prompt="JSON:", max_tokens=200, temperature=1.0, seed=2, stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}})
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"structured_outputs": {"regex": "[xyz]{3}-[0-9]"}}, lambda t: re.fullmatch("[xyz]{3}-[0-9]", t)),
    ({"guided_regex": "(no|yes)!"}, lambda t: t in ("no!", "yes!")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "<" [a-c]+ ">"'}, lambda t: re.fullmatch("<[a-c]+>", t)),
])
def test_vllm_extra_fields(client, extra, check):
    for seed in range(2):
        chat = client.chat.completions.create(model="default", messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=100, extra_body=extra)
        assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
        text = client.completions.create(model="default", prompt="ok", temperature=1.0, seed=seed, max_tokens=100,
                                         extra_body=extra).choices[0].text
        assert check(text)


@pytest.mark.parametrize("path, extra, param, message", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema"),
    ("/v1/completions", {"response_format": {"type": "grammar"}}, "response_format", "type must be one of"),
    ("/v1/completions", {"structured_outputs": {"regex": "a("}}, "structured_outputs", "invalid regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs",
     "invalid grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown field"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "only one of"),
])
def test_bad_specs_are_400_and_the_engine_keeps_serving(base_url, client, path, extra, param, message):
    body = {"model": "default", "max_tokens": 8, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})
    for _ in range(2):  # the second time from the compile cache
        response = httpx.post(base_url + path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"] and message in error["message"], error
    out = client.completions.create(model="default", prompt="still here", max_tokens=30, temperature=0,
                                    extra_body={"guided_choice": ["fine", "ok"]})
    assert out.choices[0].text in ("fine", "ok")
    now = metrics(base_url)
    assert now["flexengine:num_free_kv_blocks"] == now["flexengine:num_total_kv_blocks"]


def test_engine_loop_compiles_grammars_beside_the_steps():
    """In the engine process a new grammar compiles on a worker thread: the loop keeps stepping the other
    requests meanwhile, adds the request once compiled (or refuses it: a 400), and drops one aborted while
    it compiles."""
    import threading

    from flexengine import SamplingParams, StructuredOutputsParams
    from flexengine.config import EngineConfig
    from flexengine.engine.llm_engine import LLMEngine
    from flexengine.server.engine_process import EngineInput, EngineLoop, NewRequest

    engine = LLMEngine(EngineConfig(attention_backend="reference", seed=0, num_kv_blocks=64))
    loop = EngineLoop(engine, reader=None, writer=None)
    release = threading.Event()
    compile_ = engine.grammars._compile
    engine.grammars._compile = lambda compiler, spec: release.wait(30) and compile_(compiler, spec)

    def spec_request(rid, **spec):
        return NewRequest(rid, "hi", SamplingParams(max_tokens=40, temperature=0,
                                                    structured_outputs=StructuredOutputsParams(**spec)))

    plain = NewRequest("plain", "hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    accepted, refused = loop.apply([EngineInput(new=[spec_request("g", regex="(ab)+!"), plain,
                                                     spec_request("bad", regex="a("), spec_request("gone", choice=["z"])])])
    assert [a.request_id for a in accepted] == ["plain"] and not refused
    accepted, refused = loop.apply([EngineInput(aborts=["gone"])])
    assert not accepted and not refused and len(loop.compiling) == 2
    while engine.has_unfinished_requests():  # the other request runs to its end while the grammars compile
        engine.step_deltas()
    assert not release.is_set() and "plain" not in engine.requests
    release.set()
    for _, future in loop.compiling:
        future.result(timeout=30)
    accepted, refused = loop.apply([])
    assert [a.request_id for a in accepted] == ["g"]
    assert [(rid, "invalid regex" in message) for rid, message in refused] == [("bad", True)]
    texts = {}
    while engine.has_unfinished_requests():
        for row in engine.step_deltas():
            texts[row.request_id] = texts.get(row.request_id, "") + row.text
    assert re.fullmatch("(ab)+!", texts["g"]) and "gone" not in texts
    assert engine.num_free_blocks() == engine.num_total_blocks
