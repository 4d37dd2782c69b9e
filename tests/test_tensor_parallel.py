"""Tensor parallelism on the CPU: two gloo ranks (the test process and one spawned worker) against
transformers' own generate and against the same engine at TP=1; a per-request mask that reads the head
index; a worker killed mid-run; the bad requests that must fail before any process starts."""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams, masks
from flexengine.parallel.layers import kv_heads_of_rank

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512,
            initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# name → (config class, architecture, overrides): GQA 2:1, GQA 3:1 with head_dim 80 and a vocabulary that
# two ranks split unevenly, softcaps with sliding windows, and one KV head that both ranks replicate.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      attention_bias=True, mlp_bias=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=80,
                                                      vocab_size=301)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=2.0,
                    final_logit_softcapping=5.0)),
    "llama_one_kv_head": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1,
                                                                  tie_word_embeddings=True)),
}
ENGINE = dict(device="cpu", block_size=8, num_kv_blocks=96, max_num_seqs=8)
SHARED = [7, 3, 250, 14, 99, 5, 61, 200, 18, 42, 77, 8, 150, 31, 2, 90]  # two full pages of a shared prefix
PROMPTS = [SHARED + [11, 12, 13], [5, 9, 1], SHARED + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def greedy(n=8, **attention_params):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, attention_params=attention_params or None)


def token_ids(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def checkpoint(name, tmp_path_factory):
    cfg_cls, arch, overrides = FAMILIES[name]
    config = getattr(transformers, cfg_cls)(**{**TINY, **overrides}, architectures=[arch])
    torch.manual_seed(0)
    hf = getattr(transformers, arch)._from_config(config, attn_implementation="eager")
    with torch.no_grad():  # norms and biases away from their init, so that sharding them wrongly shows
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = str(tmp_path_factory.mktemp(name))
    hf.eval().save_pretrained(path)
    return hf, path


def hf_greedy(hf, prompt, n=8):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def no_children_left():
    gc.collect()  # an engine nobody holds stops its workers when it is collected
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not multiprocessing.active_children()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])  # llama_one_kv_head: in the killed-worker test
def test_two_ranks_match_transformers_and_one_rank(name, tmp_path_factory):
    hf, path = checkpoint(name, tmp_path_factory)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    threads = torch.get_num_threads()
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert torch.get_num_threads() == min(threads, max(1, (os.cpu_count() or 1) // 2))  # rank 0's share
        runner = llm.llm_engine.runner
        heads = hf.config.num_attention_heads
        assert runner.layers[0].num_heads == heads // 2  # each rank holds its half of the query heads
        assert runner.num_kv_heads == kv_heads_of_rank(hf.config.num_key_value_heads, 0, 2)[1]
        got, _ = token_ids(llm, PROMPTS, greedy())
        assert got == expected
        again, outs = token_ids(llm, PROMPTS, greedy())  # the shared prefix now comes from the cache
        assert again == expected
        assert [o.num_cached_tokens for o in outs] == [16, 0, 24]  # its whole pages of the first run
    finally:
        llm.llm_engine.shutdown()
    assert no_children_left() and torch.get_num_threads() == threads  # the cores are the process's again
    with pytest.raises(RuntimeError, match="was shut down"):
        token_ids(llm, PROMPTS, greedy())
    assert token_ids(LLM(path, **ENGINE), PROMPTS, greedy())[0] == expected


def test_async_scheduling_logprobs_and_prompt_logprobs_equal_one_rank(tmp_path_factory):
    """Rank 0 feeds each step's pending tokens on the device (the workers get them inside the model), and
    every logits call (sampling, prompt logprobs) gathers the vocabulary from both ranks."""
    _, path = checkpoint("qwen3", tmp_path_factory)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    llm = LLM(path, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    try:
        _, two = token_ids(llm, PROMPTS, params)
    finally:
        llm.llm_engine.shutdown()
    _, one = token_ids(LLM(path, **ENGINE), PROMPTS, params)
    for a, b in zip(two, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:])
        for got, want in pairs:
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)


@settings(max_examples=200, deadline=None)
@given(kv_heads=st.integers(1, 16), group=st.integers(1, 8), size=st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
def test_every_rank_holds_the_kv_heads_its_query_heads_read(kv_heads, group, size):
    """Plain GQA arithmetic as the reference: global query head g reads KV head g // group. A rank runs its
    heads locally (local query head i reads local KV head i // (its q heads / its kv heads)); that must be
    the same KV head, and every query head must belong to exactly one rank."""
    heads = kv_heads * group
    if heads % size:
        return  # refused for the query heads (test_a_size_that_does_not_divide_the_heads_...)
    if kv_heads % size and size % kv_heads:
        message = rf"tensor_parallel_size={size} (is more than the {kv_heads} KV heads|.*KV heads \({kv_heads}\))"
        with pytest.raises(ValueError, match=message):
            kv_heads_of_rank(kv_heads, 0, size)
        return
    per_rank, owners = heads // size, []
    for rank in range(size):
        first_kv, local_kv = kv_heads_of_rank(kv_heads, rank, size)
        assert per_rank % local_kv == 0
        for i in range(per_rank):
            g = rank * per_rank + i
            owners.append(g)
            assert first_kv + i // (per_rank // local_kv) == g // group
    assert owners == list(range(heads))


def head_span_mask(b, h, q_idx, kv_idx, span):
    """Causal, and head h sees only the last span * (h + 1) keys: the heads of rank 1 see more than rank 0's."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < span[b] * (h + 1))


def local_head_span_mask(b, h, q_idx, kv_idx, span):
    """What head_span_mask would compute on two ranks if the mod were handed rank-local head indices."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < span[b] * (h % 2 + 1))


def test_per_request_mask_sees_global_heads(tmp_path_factory):
    _, path = checkpoint("llama", tmp_path_factory)
    params = [greedy(6, span=s) for s in (1, 3, 2)]
    llm = LLM(path, tensor_parallel_size=2, mask_mod=head_span_mask, **ENGINE)
    try:
        tp2, _ = token_ids(llm, PROMPTS, params)
    finally:
        llm.llm_engine.shutdown()
    one = LLM(path, mask_mod=head_span_mask, **ENGINE)
    assert tp2 == token_ids(one, PROMPTS, params)[0]
    reference = LLM(path, mask_mod=head_span_mask, attention_backend="reference", **ENGINE)
    assert tp2 == token_ids(reference, PROMPTS, params)[0]
    # The test can fail: local head indices give other tokens.
    wrong = LLM(path, mask_mod=local_head_span_mask, **ENGINE)
    assert tp2 != token_ids(wrong, PROMPTS, params)[0]
    assert no_children_left()


def test_alibi_slopes_follow_the_global_head_and_closures_reach_the_workers(tmp_path_factory):
    """alibi(slopes) is a closure (sent by value) whose slope is indexed by h: rank 1 must read slopes 2 and 3."""
    _, path = checkpoint("llama", tmp_path_factory)
    slopes = torch.tensor([0.0, 0.05, 1.5, 4.0])
    settings = dict(score_mod=masks.alibi(slopes), mask_mod=masks.sliding_window(12), **ENGINE)
    llm = LLM(path, tensor_parallel_size=2, **settings)
    try:
        tp2, _ = token_ids(llm, PROMPTS, greedy(6))
    finally:
        llm.llm_engine.shutdown()
    assert tp2 == token_ids(LLM(path, **settings), PROMPTS, greedy(6))[0]
    local = dict(settings, score_mod=masks.alibi(slopes[[0, 1, 0, 1]]))  # what rank-local indices would read
    assert tp2 != token_ids(LLM(path, **local), PROMPTS, greedy(6))[0]


def test_a_killed_worker_fails_the_call_within_seconds(tmp_path_factory):
    hf, path = checkpoint("llama_one_kv_head", tmp_path_factory)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    # First, the one KV head both ranks hold a copy of gives transformers' tokens.
    assert llm.llm_engine.runner.num_kv_heads == 1
    assert token_ids(llm, PROMPTS, greedy())[0] == [hf_greedy(hf, p) for p in PROMPTS]
    worker = llm.llm_engine.runner.workers.procs[0]
    killed = []

    def kill():
        killed.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 .* exited with code -9"):
        while time.monotonic() - started < 60:  # requests keep coming until the worker dies
            token_ids(llm, PROMPTS, greedy(64))
    assert killed and time.monotonic() - killed[0] < 10
    timer.join()
    assert no_children_left()
    with pytest.raises(RuntimeError, match="cannot run more steps"):  # and every later call says so at once
        token_ids(llm, PROMPTS[:1], greedy(2))


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited process stays one until it is reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_end_when_rank_0_is_killed(tmp_path_factory, tmp_path):
    """Rank 0 killed (SIGKILL: no finalizer runs) while idle, the workers waiting for its next step: they see the
    pipe close and end within seconds, instead of holding their devices as orphans."""
    import subprocess
    import sys
    _, path = checkpoint("llama", tmp_path_factory)
    script = tmp_path / "rank0.py"
    script.write_text(f"""
from flexengine import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({path!r}, tensor_parallel_size=2, **{ENGINE!r})
    llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=4), use_tqdm=False)
    print("WORKER", llm.llm_engine.runner.workers.procs[0].pid, flush=True)
    import time
    time.sleep(600)
""")
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = rank0.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        time.sleep(0.5)  # the worker waits for the next step
        rank0.kill()
        rank0.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and running(worker):
            time.sleep(0.1)
        assert not running(worker), "the worker outlived rank 0"
    finally:
        rank0.kill()


@pytest.mark.parametrize("name,size,message", [
    ("llama", 3, r"tensor_parallel_size=3 does not divide the number of attention heads \(4\)"),
    ("qwen3", 4, r"tensor_parallel_size=4 does not divide the number of attention heads \(6\)"),
])
def test_a_size_that_does_not_divide_the_heads_fails_before_any_process(name, size, message, tmp_path_factory):
    _, path = checkpoint(name, tmp_path_factory)
    with pytest.raises(ValueError, match=message):
        LLM(path, tensor_parallel_size=size, **ENGINE)
    assert not multiprocessing.active_children()


def test_more_ranks_than_gpus_and_nccl_without_cuda_fail_before_any_process(tmp_path_factory, monkeypatch):
    _, path = checkpoint("llama", tmp_path_factory)
    monkeypatch.setenv("FLEXENGINE_DIST_BACKEND", "nccl")
    with pytest.raises(ValueError, match=r"FLEXENGINE_DIST_BACKEND=nccl needs CUDA.*device_count\(\) = 0"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    monkeypatch.delenv("FLEXENGINE_DIST_BACKEND")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs \(cuda:0..cuda:1\), but 1 is visible"):
        LLM(path, tensor_parallel_size=2, **{**ENGINE, "device": "cuda"})
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("choice", ["one_shot", "torch_one_shot"])
def test_one_shot_all_reduce_is_refused_off_cuda(choice, tmp_path_factory, monkeypatch):
    """FLEXENGINE_ALL_REDUCE=one_shot (or torch_one_shot) off CUDA is a ValueError before any process; an unknown
    value names the choices. (Which sums take which kernel: tests/test_one_shot.py.)"""
    _, path = checkpoint("llama", tmp_path_factory)
    monkeypatch.setenv("FLEXENGINE_ALL_REDUCE", choice)
    with pytest.raises(ValueError, match=rf"FLEXENGINE_ALL_REDUCE={choice} .* needs CUDA devices, but device='cpu'"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    monkeypatch.setenv("FLEXENGINE_ALL_REDUCE", "custom")
    with pytest.raises(ValueError, match=r"FLEXENGINE_ALL_REDUCE must be one of auto, nccl, one_shot, "
                                         r"torch_one_shot, got 'custom'"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    assert not multiprocessing.active_children()


def test_auto_all_reduce_takes_one_shot_only_where_every_gpu_pair_has_peer_access(monkeypatch):
    """auto (the default): one_shot on CUDA where each pair of the group's GPUs reads the other's memory, NCCL
    otherwise, at size 1 and off CUDA; every rank of a group decides alike; nccl and one_shot force it."""
    from flexengine.parallel.collectives import one_shot_or_nccl
    blocked = set()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) not in blocked)
    monkeypatch.delenv("FLEXENGINE_ALL_REDUCE", raising=False)
    assert [one_shot_or_nccl(2, r, torch.device("cuda", 2 + r)) for r in (0, 1)] == ["one_shot"] * 2
    assert one_shot_or_nccl(1, 0, torch.device("cuda", 0)) == "nccl"
    assert one_shot_or_nccl(2, 0, torch.device("cpu")) == "nccl"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)  # LLM(device="auto")'s rank 0: "cuda", no index
    assert one_shot_or_nccl(2, 0, torch.device("cuda")) == "one_shot"
    blocked.add((3, 2))  # cuda:3 cannot read cuda:2: both ranks of cuda:2-3 stay on NCCL, cuda:0-1 are unaffected
    assert one_shot_or_nccl(2, 0, torch.device("cuda")) == "nccl"
    assert [one_shot_or_nccl(2, r, torch.device("cuda", 2 + r)) for r in (0, 1)] == ["nccl"] * 2
    assert one_shot_or_nccl(2, 1, torch.device("cuda", 1)) == "one_shot"
    for forced in ("one_shot", "torch_one_shot"):
        monkeypatch.setenv("FLEXENGINE_ALL_REDUCE", forced)
        assert one_shot_or_nccl(2, 0, torch.device("cuda", 2)) == forced
    monkeypatch.setenv("FLEXENGINE_ALL_REDUCE", "nccl")
    assert one_shot_or_nccl(2, 0, torch.device("cuda", 0)) == "nccl"


def test_settings_that_do_not_pickle_are_a_value_error(tmp_path_factory):
    _, path = checkpoint("llama", tmp_path_factory)
    lock = threading.Lock()

    def locked_causal(b, h, q_idx, kv_idx):  # holds a lock, which no pickler sends to another process
        with lock:
            return kv_idx <= q_idx

    with pytest.raises(ValueError, match="do not pickle"):
        LLM(path, tensor_parallel_size=2, mask_mod=locked_causal, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(path, tensor_parallel_size=0, **ENGINE)
    gguf = tmp_path_factory.mktemp("gguf") / "model.gguf"
    gguf.write_bytes(b"")  # never read: refused by its name first
    with pytest.raises(ValueError, match="model.gguf is a GGUF file"):
        LLM(str(gguf), tensor_parallel_size=2, **ENGINE)
    assert not multiprocessing.active_children()


def test_generate_cli_takes_the_flag(capsys):
    from flexengine.cli import main
    args = ["generate", "--device", "cpu", "--temperature", "0", "--max-tokens", "6", "--json", "Hello there"]
    assert main(args + ["--tensor-parallel-size", "2"]) == 0  # the embedded default model, sharded
    two = capsys.readouterr().out
    assert no_children_left()
    assert main(args) == 0
    assert capsys.readouterr().out == two


TORCHRUN_SCRIPT = """
import json, sys
from flexengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", block_size=8, num_kv_blocks=96)
# Ranks > 0 serve rank 0's steps inside LLM(...) and exit when it shuts down: only rank 0 gets here.
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.llm_engine.shutdown()
"""


def test_torchrun_launches_the_ranks(tmp_path_factory, tmp_path):
    import json
    import socket
    import subprocess
    import sys
    hf, path = checkpoint("llama", tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(port), str(script), path, json.dumps(PROMPTS)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # printed by rank 0 alone
    assert json.loads(lines[0][len("TOKENS "):]) == [hf_greedy(hf, p) for p in PROMPTS]


def test_the_parity_script_of_the_two_gpu_run(tmp_path_factory, tmp_path):
    """scripts/tp_parity.py (issue 23's parity and speed, one process per size) on two gloo ranks: float32 tokens
    agree, and the speed rows come out."""
    import json
    import subprocess
    import sys
    _, path = checkpoint("llama", tmp_path_factory)
    out = tmp_path / "parity.json"
    subprocess.run([sys.executable, "scripts/tp_parity.py", "--model", path, "-tp", "2", "--device", "cpu",
                    "--num-prompts", "2", "--input-len", "8", "--max-tokens", "4", "--json", str(out),
                    "--speed", "--speed-batch", "3", "--speed-len", "4"],
                   check=True, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=300)
    report = json.loads(out.read_text())
    assert report["identical"] == 2 and report["max_logprob_diff"] < 1e-4 and report["positions"] == 2 * 4
    assert report["median_logprob_diff"] <= report["p90_logprob_diff"] <= report["max_logprob_diff"]
    assert len(report["noise"]["prompts"]) == 2 and report["noise"]["max_logprob_diff"] < 1e-4  # float32: no noise
    for size in ("1", "2"):  # the speed rows the GPU run reports, from the same engines
        speed = report["speed"][size]
        assert speed["batch1_ms_per_token"] > 0 and len(speed["output_tokens_per_s"]) == 2, speed
    assert all(g["compiled_after_warm_up"] == 0 for g in report["graphs"].values())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (issue 23's nvidia-h200-x2)")
def test_two_gpus_capture_the_all_reduces_and_match_one(tmp_path_factory):
    """NCCL on two GPUs: decode and mixed steps replay CUDA graphs that hold the all-reduces, nothing compiles
    after the warm-up, and float32 greedy tokens and logprobs equal one GPU's."""
    from flexengine.compile import compile_count
    _, path = checkpoint("qwen3", tmp_path_factory)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine = dict(dtype="float32", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128)  # few graphs
    llm = LLM(path, tensor_parallel_size=2, **engine)
    try:
        runner = llm.llm_engine.runner
        assert runner.decode_graphs is not None and runner.mixed_graphs is not None
        token_ids(llm, PROMPTS[:1], params)
        before = compile_count()
        _, two = token_ids(llm, PROMPTS, params)
        assert compile_count() == before, "a shape compiled after warm-up"
    finally:
        llm.llm_engine.shutdown()
    assert no_children_left()
    _, one = token_ids(LLM(path, enforce_eager=True, **engine), PROMPTS, params)  # eager: no second warm-up
    for a, b in zip(two, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-3 for t in got.keys() & want.keys())
