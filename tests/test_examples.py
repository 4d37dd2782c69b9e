"""Every example, and the README's "Write your own attention" code, runs as written (default model, no
GPU needed), exits 0 and prints what it claims."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexengine.config import BACKEND_ENV

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

# What each example claims, as regexes over its stdout.
CLAIMS = {
    "offline_generate.py": [r"'Hello, my name is' -> '.+' \(12 tokens, length\)", r"generated 36 tokens for 3 prompts"],
    "custom_mask_mod.py": [r"flex == dense reference: same greedy tokens", r"differs from plain causal attention: True"],
    "prefix_lm_requests.py": [r"prefix_len  0 of \d+ prompt tokens", r"prefix_len \d+ of \d+ prompt tokens.*\n.*"
                              r"prefix_len \d+ of \d+", r"batched == each request alone"],
    "attention_gym_mods.py": [r"gym mods: flex == dense reference", r"per-request prefix_len == gym's mask per request"],
    "compare_backends.py": [r"flex .* s  first completion", r"reference .* s  first completion",
                            r"flash +(unavailable: .*cannot serve|.* s  first completion)",
                            r"flex +matches reference on 3/3 prompts"],
}


def readme_code(section: str) -> str:
    body = (ROOT / "README.md").read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every script at once (they are mostly start-up time), then wait: {name: (exit code, stdout)}."""
    tmp = tmp_path_factory.mktemp("examples")
    readme = tmp / "write_your_own_attention.py"
    readme.write_text(readme_code("Write your own attention"))
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}
    jobs = {name: ([sys.executable, str(ROOT / "examples" / name)], env) for name in EXAMPLES}
    jobs["README"] = ([sys.executable, str(readme)], env)
    jobs["README, reference"] = ([sys.executable, str(readme)], {**env, BACKEND_ENV: "reference"})
    procs = {}
    for i, (name, (cmd, job_env)) in enumerate(jobs.items()):
        out = open(tmp / f"{i}.out", "w+")
        procs[name] = (subprocess.Popen(cmd, cwd=tmp, env=job_env, stdout=out, stderr=subprocess.STDOUT, text=True),
                       out)
    results = {}
    for name, (proc, out) in procs.items():
        code = proc.wait(timeout=600)
        out.seek(0)
        results[name] = (code, out.read())
        out.close()
    return results


def test_every_example_has_its_claims_listed():
    assert set(EXAMPLES) == set(CLAIMS)


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_example_runs_and_prints_what_it_claims(runs, name):
    code, out = runs[name]
    assert code == 0, out
    for claim in CLAIMS[name]:
        assert re.search(claim, out), f"{name} did not print {claim!r}:\n{out}"


def test_readme_write_your_own_attention_runs_and_the_env_override_agrees(runs):
    (code, flex), (ref_code, reference) = runs["README"], runs["README, reference"]
    assert code == 0 and ref_code == 0, flex + reference
    text = [line for line in flex.splitlines() if line.strip()]
    assert text, "the README example printed nothing"
    assert text[-1] == [line for line in reference.splitlines() if line.strip()][-1]
