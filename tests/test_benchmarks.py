"""End-to-end benchmarks on CPU at tiny sizes: each main() runs, prints lines that parse, and its
numbers add up; e2e_bench.sh's commands parse. The timings themselves mean nothing here."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess

import pytest
import torch

from flexengine import cli
from flexengine.benchmarks import compare_transformers
from flexengine.benchmarks.common import decode_ms_per_token, random_prompts, weight_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--enforce-eager", "--num-kv-blocks", "16"]
NUM = r"(-?[0-9.]+(?:e[-+]?\d+)?)"


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"no line matches {pattern!r} in:\n{text}"
    return float(match.group(1))


def test_random_prompts_fixed_by_seed_and_in_vocab():
    a, b = random_prompts(3, 5, 7, seed=1), random_prompts(3, 5, 7, seed=1)
    assert a == b and len(a) == 3 and all(len(p) == 5 and all(0 <= t < 7 for t in p) for p in a)
    assert random_prompts(3, 5, 1000, seed=2) != random_prompts(3, 5, 1000, seed=1)


def test_weight_bytes_counts_a_tied_weight_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict(dict(emb=emb, head=head, norm=torch.nn.LayerNorm(4)))
    assert weight_bytes(model) == (10 * 4 + 4 + 4) * 4
    assert weight_bytes(model.to(torch.bfloat16)) == (10 * 4 + 4 + 4) * 2


def test_decode_ms_per_token_cancels_prefill():
    assert decode_ms_per_token([1.2, 1.0, 1.1], [0.1, 0.1, 0.3], 11) == pytest.approx(100.0)


def test_throughput_prints_vllm_line(capsys, tmp_path):
    out_json = tmp_path / "t.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                     *TINY, "--json-out", str(out_json)]) == 0
    out = capsys.readouterr().out
    m = re.search(rf"^Throughput: {NUM} requests/s, {NUM} total tokens/s, {NUM} output tokens/s$", out, re.M)
    assert m, out
    req, total, output = map(float, m.groups())
    assert output == pytest.approx(req * 4, rel=2e-2) and total == pytest.approx(output * 3, rel=2e-2)
    assert number(rf"^Cold start \(load \+ compile \+ graph capture\): {NUM} s", out) > 0
    result = json.loads(out_json.read_text())
    assert result["num_prompts"] == 4 and result["output_tokens_per_s"] == pytest.approx(output, abs=0.01)
    assert result["output_tokens_per_s"] * result["elapsed_s"] == pytest.approx(4 * 4)


@pytest.mark.parametrize("name, rate", [("NVIDIA H100 80GB HBM3", 3.0e12), ("NVIDIA H200", 4.3e12),
                                        ("NVIDIA A100-SXM4-80GB", 3.0e12), (None, 3.0e12)])
def test_the_floor_s_bandwidth_follows_the_gpu(monkeypatch, name, rate):
    """The H200's floors at its own bandwidth (its weight-read floor is ~30% below the H100's); any other GPU, or
    none, at the H100's."""
    from flexengine.benchmarks import common
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert common.hbm_bytes_per_s() == rate


def test_latency_prints_decode_floor_and_fraction(capsys, tmp_path):
    out_json = tmp_path / "l.json"
    assert cli.main(["bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                     "--num-iters", "2", "--num-iters-warmup", "0", *TINY, "--json-out", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert number(rf"^Avg latency: {NUM} seconds$", out) > 0
    ms = number(rf"^Decode: {NUM} ms per output token", out)
    floor = number(rf"^Weight-read floor: {NUM} ms per step", out)
    number(rf"^Achieved fraction of floor: {NUM}$", out)
    result = json.loads(out_json.read_text())
    assert len(result["full_s"]) == len(result["one_s"]) == 2
    assert result["ms_per_token"] == pytest.approx(ms, abs=1e-3)
    # The embedded default model: 107,200 fp32 parameters, no tied embedding.
    assert result["weight_bytes"] == 107_200 * 4 and floor == pytest.approx(107_200 * 4 / 3.0e12 * 1e3, rel=1e-3)


@pytest.fixture(scope="module")
def tiny_hf_checkpoint(tmp_path_factory):
    """A tied-embedding Llama written by transformers itself, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters()) * 4  # transformers counts a tied weight once


def test_compare_transformers_table(tiny_hf_checkpoint, capsys, tmp_path):
    # generate_batch runs on CPU in transformers 5.x, given explicit cache sizes (the CLI sets them on CPU).
    path, hf_bytes = tiny_hf_checkpoint
    parser = argparse.ArgumentParser()
    compare_transformers.add_arguments(parser)
    out_json = tmp_path / "c.json"
    args = parser.parse_args(["--model", path, "--dtype", "float32", "--num-prompts", "4", "--tf-num-prompts", "3",
                              "--input-len", "8", "--output-len", "4", "--batch1", "--batch1-input-len", "8",
                              "--batch1-output-len", "4", "--batch1-iters", "1", *TINY, "--json-out", str(out_json)])
    assert compare_transformers.main(args) == 0
    out = capsys.readouterr().out
    seconds = number(rf"^\| flexengine \(flex, eager\) \| 4 \| {NUM} \| {NUM} \| {NUM} s / {NUM} s \|$", out)
    ttft = json.loads(out_json.read_text())["rows"][-1]["ttft"]
    assert 0 < ttft["median"] <= ttft["p90"] <= seconds, ttft  # first tokens come within the run
    for engine in ("transformers generate, dynamic cache", "transformers generate, static cache",
                   r"flexengine \(flex, eager\)"):
        number(rf"^\| {engine} \| {NUM} \|$", out)
    result = json.loads(out_json.read_text())
    assert result["weight_bytes"] == hf_bytes  # the tied embedding counted once, as transformers counts it
    assert len(result["batch1"]) == 3
    missing = re.search(r"^transformers generate_batch row missing: (.*)$", out, re.M)
    if missing:  # e.g. transformers 5.17 on CPU without psutil sees no free memory; on a GPU it runs
        pytest.skip(f"generate_batch could not run on this CPU (the rest was checked): {missing.group(1)}")
    attn = re.escape(compare_transformers.paged_sdpa().replace("|", "\\|"))  # (a table cell escapes its "|")
    assert number(rf"^\| transformers \S+ generate_batch \({attn}\) \| 3 \| {NUM} \| {NUM} \| .+ \|$", out) > 0
    assert "(transformers ran 3 prompts, flexengine 4)" in out
    number(rf"^flexengine / transformers output tok/s: {NUM}x", out)
    assert [r["prompts"] for r in result["rows"]] == [3, 4]


def test_e2e_script_commands_parse(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), BATCH1="1", MODEL_DIR=str(tmp_path / "model"))
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e_bench.sh")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    commands = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("=== ")]
    assert len(commands) == 6, run.stdout
    for command in commands:
        argv = shlex.split(command)
        assert argv[1] == "-m", command
        if argv[2] == "flexengine.cli":
            cli.build_parser(argv[3:]).parse_args(argv[3:])
        else:
            assert argv[2] == "flexengine.benchmarks.compare_transformers"
            parser = argparse.ArgumentParser()
            compare_transformers.add_arguments(parser)
            assert parser.parse_args(argv[3:]).batch1


def test_every_benchmark_takes_max_model_len(capsys):
    """vLLM's --max-model-len reaches the engine from every benchmark's engine flags."""
    from flexengine.benchmarks.common import add_engine_arguments, build_llm
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    llm, _ = build_llm(parser.parse_args([*TINY, "--max-model-len", "48"]))
    assert llm.llm_engine.max_model_len == 48
    for bench in ("throughput", "latency"):
        with pytest.raises(SystemExit) as help_exit:
            cli.main(["bench", bench, "--help"])
        assert help_exit.value.code == 0 and "--max-model-len" in capsys.readouterr().out, bench
    compare = argparse.ArgumentParser()
    compare_transformers.add_arguments(compare)
    assert compare.parse_args(["--max-model-len", "64"]).max_model_len == 64
