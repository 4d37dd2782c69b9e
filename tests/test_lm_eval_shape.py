"""The request lm-eval's `local-completions` model sends for every loglikelihood (multiple-choice) score,
answered by the server app in this process, and read back the way lm-eval 0.4.13 reads it: the
continuation's loglikelihood and is-greedy flag equal transformers' log_softmax over the same tokens.

lm-eval itself (about 40 packages, 410 MB installed: pyarrow, pandas, scikit-learn...) stays out of `dev`;
scripts/lm_eval_parity.py runs it end to end on a real model. Its parser is checked here only where it
is installed.
"""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
from fastapi.testclient import TestClient  # noqa: E402

from flexengine.config import EngineConfig  # noqa: E402
from flexengine.models.default_model import default_model_path  # noqa: E402
from flexengine.server.api_server import build_app  # noqa: E402
from flexengine.server.async_engine import AsyncEngine  # noqa: E402
from flexengine.server.engine_process import EngineProcess  # noqa: E402
from flexengine.server.metrics import parse_metrics  # noqa: E402

MODEL = "lm-eval-target"
VOCAB = 256  # the byte tokens of the default model (its specials, 256-258, are left out)
MAX_MODEL_LEN = 96


def lm_eval_payload(prompts: list[list[int]], max_tokens: int = 1) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False) of lm-eval 0.4.13: token-id prompts, always a list
    of them (one per request in the batch)."""
    return {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}


def lm_eval_parse(response: dict, ctxlens: list[int], max_tokens: int = 1) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs, written out: choices in index order; the continuation's logprobs
    are token_logprobs[ctxlen:-1] (the last entry is the token generated after the prompt; with
    max_tokens=0 there is none, so the slice runs to the end); greedy when each equals its top-1."""
    out = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        end = len(choice["logprobs"]["token_logprobs"]) - max_tokens
        lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        out.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return out


@pytest.fixture(scope="module")
def hf():
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def client():
    """The app `flexengine serve` runs, on the default tiny model in float32: 4-token pages and a 16-token
    step budget, so prompts cross pages and their prefills are chunked; the prefix cache is on (lm-eval's
    choices share a context)."""
    config = EngineConfig(model=default_model_path(), dtype="float32", device="cpu", attention_backend="reference",
                          block_size=4, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16,
                          enable_prefix_caching=True, async_scheduling=False)
    engine = AsyncEngine(EngineProcess.start(config), config.max_num_seqs, 64)
    with TestClient(build_app(engine, MODEL)) as c:
        yield c


def reference(hf, ids: list[int], ctxlen: int) -> tuple[float, bool, float]:
    """(loglikelihood of ids[ctxlen:] given ids[:ctxlen], whether each was the argmax, the logprob of the
    greedy token after ids)."""
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rows, targets = logp[ctxlen - 1:len(ids) - 1], torch.tensor(ids[ctxlen:])
    chosen = rows[torch.arange(len(targets)), targets]
    return chosen.sum().item(), bool((rows.argmax(-1) == targets).all()), logp[-1].max().item()


def greedy_tokens(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


request = st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 10_000), st.booleans())


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(request, min_size=1, max_size=4), shared_context=st.booleans(),
       max_tokens=st.sampled_from([1, 0]))
def test_lm_eval_loglikelihood_matches_transformers(client, hf, batch, shared_context, max_tokens):
    """A batch of (context, continuation) pairs in one request, as lm-eval batches them; with
    shared_context every pair scores another continuation of the first context, as a multiple-choice
    question does (the prefix cache holds the context by the second). Some continuations are the model's
    own greedy tokens, so lm-eval's is-greedy flag is seen both ways."""
    first_context = None
    prompts, ctxlens, expected = [], [], []
    for ctx_len, cont_len, seed, greedy in batch:
        g = torch.Generator().manual_seed(seed)
        context = torch.randint(0, VOCAB, (ctx_len,), generator=g).tolist()
        if shared_context:
            first_context = first_context or context
            context = first_context
        continuation = (greedy_tokens(hf, context, cont_len) if greedy
                        else torch.randint(0, VOCAB, (cont_len,), generator=g).tolist())
        ids = context + continuation
        prompts.append(ids)
        ctxlens.append(len(context))
        expected.append(reference(hf, ids, len(context)))

    response = client.post("/v1/completions", json=lm_eval_payload(prompts, max_tokens))
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == len(prompts)
    for (ll, is_greedy), (ref_ll, ref_greedy, _) in zip(lm_eval_parse(body, ctxlens, max_tokens), expected):
        assert ll == pytest.approx(ref_ll, abs=2e-3)
        assert is_greedy == ref_greedy
    for choice, ids, (_, _, next_logprob) in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts,
                                                  expected):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # logprobs=1: the top-1 alone
        if max_tokens:  # one greedy token after the prompt: transformers' most likely one
            assert lp["token_logprobs"][-1] == pytest.approx(next_logprob, abs=2e-3)
            assert lp["top_logprobs"][-1] == {lp["tokens"][-1]: lp["token_logprobs"][-1]}
            assert choice["text"].endswith(lp["tokens"][-1])
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)


def test_lm_eval_bad_requests_are_400_and_leak_no_pages(client, hf):
    """What lm-eval sends when a prompt is out of range: a 400 naming the prompt, no pages held after, and
    the next good request answered."""
    too_long = list(range(MAX_MODEL_LEN + 1))
    for prompts in ([[1, 2, 3], too_long], [[1, 2, VOCAB + 100_000]], [[]]):
        response = client.post("/v1/completions", json=lm_eval_payload(prompts))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt", response.text
    ids = [5, 6, 7, 8, 9, 10]
    good = client.post("/v1/completions", json=lm_eval_payload([ids]))
    assert good.status_code == 200, good.text
    [(ll, _)] = lm_eval_parse(good.json(), [3])
    assert ll == pytest.approx(reference(hf, ids, 3)[0], abs=2e-3)
    assert wait_all_pages_free(client)


def wait_all_pages_free(client, timeout: float = 10.0) -> bool:
    """/metrics reads the engine's last snapshot, which may trail the last answer by a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = parse_metrics(client.get("/metrics").text)
        if m["flexengine:num_free_kv_blocks"] == m["flexengine:num_total_kv_blocks"]:
            return True
        time.sleep(0.05)
    return False


def test_lm_eval_own_parser_agrees(client):
    """lm-eval's own parse_logprobs on the server's answer gives what lm_eval_parse gives (where lm-eval is
    installed: it is not in `dev`)."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    prompts = [[72, 101, 108, 108, 111, 32, 119], [72, 101, 108, 108, 111, 33]]
    body = client.post("/v1/completions", json=lm_eval_payload(prompts)).json()
    ours = lm_eval_parse(body, [5, 5])
    theirs = completions.LocalCompletionsAPI.parse_logprobs(outputs=body, tokens=prompts, ctxlens=[5, 5])
    assert ours == theirs
