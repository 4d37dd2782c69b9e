"""`flexengine bench throughput --penalties` and `--prompt-logprobs K` (issue 20's GPU targets), at tiny sizes
on the CPU: they run, count their tokens exactly, and exclude one another and --json-schemas."""
import json

import pytest

from flexengine import cli

TINY = ["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--attention-backend", "reference",
        "--num-kv-blocks", "32"]


def run_bench(tmp_path, *flags) -> dict:
    out_json = tmp_path / "bench.json"
    assert cli.main([*TINY, *flags, "--json-out", str(out_json)]) == 0
    return json.loads(out_json.read_text())


def test_penalties_benchmark(tmp_path):
    result = run_bench(tmp_path, "--output-len", "6", "--penalties")
    assert result["bench"] == "throughput_penalties" and result["output_tokens"] == 2 * 4 * 6  # two runs a side
    assert result["ratio"] > 0 and result["penalised_tokens_per_s"] > 0 and result["plain_tokens_per_s"] > 0
    assert len(result["plain_runs_s"]) == len(result["penalised_runs_s"]) == 2


def test_prompt_logprobs_benchmark(tmp_path):
    result = run_bench(tmp_path, "--prompt-logprobs", "1")
    assert result["bench"] == "throughput_prompt_logprobs" and result["prompt_logprobs"] == 1
    assert result["prompt_tokens"] == 2 * 4 * 8 and result["ratio"] > 0
    assert len(result["plain_runs_s"]) == len(result["prompt_logprobs_runs_s"]) == 2


@pytest.mark.parametrize("flags", [["--penalties", "--prompt-logprobs", "1"], ["--json-schemas", "1", "--penalties"],
                                   ["--json-schemas", "16", "--prompt-logprobs", "1"]])
def test_benchmark_modes_exclude_one_another(flags, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, *flags])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_the_sampling_suite_runs_every_workload_on_one_engine(tmp_path):
    """scripts/sampling_suite.py (gpu_session.sh's sampling stage): the four workloads, one start-up."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(__file__))
    subprocess.run([sys.executable, "scripts/sampling_suite.py", "--num-prompts", "4", "--input-len", "8",
                    "--output-len", "4", "--num-kv-blocks", "64", "--attention-backend", "reference",
                    "--out", str(tmp_path)], check=True, cwd=root, timeout=300, capture_output=True)
    results = {name: json.loads((tmp_path / f"sampling_{name}.json").read_text())
               for name in ("json_schemas_1", "json_schemas_16", "penalties", "prompt_logprobs")}
    assert results["json_schemas_16"]["json_schemas"] == 16 and results["penalties"]["output_tokens"] == 2 * 4 * 4
    assert results["prompt_logprobs"]["num_prompts"] == 1000 and all(r["ratio"] > 0 for r in results.values())


def test_step_host_time_times_the_sampling_workloads_on_one_engine():
    """scripts/step_host_time.py --workload plain,json,penalties (gpu_session.sh's host_sampling stage): each
    workload's table, with the grammar's and the penalties' host functions where they run."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(__file__))
    run = subprocess.run([sys.executable, "scripts/step_host_time.py", "--num-prompts", "4", "--input-len", "8",
                          "--output-len", "3", "--num-kv-blocks", "64", "--workload", "plain,json,penalties"],
                         check=True, cwd=root, timeout=300, capture_output=True, text=True)
    tables = run.stdout.split("# ")[1:]
    assert [t.split(" |")[0] for t in tables] == ["plain", "json", "penalties"]
    plain, json_mode, penalties = tables
    assert "fill_token_mask" in json_mode and "accept_tokens" in json_mode and "fill_token_mask" not in plain
    assert "LogitsAdjuster" in penalties and "LogitsAdjuster" not in json_mode
    assert all("per step: wall" in t for t in tables)
