"""lm-eval through `flexengine serve` against lm-eval's own transformers backend (issue 20).

One command runs EleutherAI's lm-evaluation-harness twice on the same multiple-choice task
(tests/data/lm_eval_mc, local JSONL, no hub access) and the same checkpoint, SmolLM2-135M-Instruct (Q4_1
GGUF from flexengine's cache) in float32:
  1. `--model local-completions` against `flexengine serve smollm2-135m-instruct --dtype float32`
     (flexengine dequantizes the GGUF with its own loader);
  2. `--model hf` with `gguf_file=` (transformers dequantizes the same file).
Then it pairs the per-request loglikelihoods of both runs' --log_samples and prints a table, the largest
|Δ loglikelihood| and both accuracies. Exit status 1 when |Δ| passes --tol or the accuracies differ.

    pip install "lm-eval[api]"
    python scripts/lm_eval_parity.py            # from the repository root; CPU, about two minutes

The server's run needs a tokenizer lm-eval can load without the hub: the GGUF's, saved once as a
transformers tokenizer directory under --workdir (the hf run reads the same one from the GGUF).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join("tests", "data", "lm_eval_mc")  # its YAML names the JSONL relative to the repo root
TASK = "flexengine_mc"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tokenizer(gguf: str, out: str) -> str:
    """The GGUF's tokenizer as a transformers directory (what local-completions' tokenizer= loads)."""
    if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
        from transformers import AutoTokenizer
        d, f = os.path.split(gguf)
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
    return out


def start_server(port: int, log_path: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flexengine.cli", "serve", MODEL, "--dtype", "float32", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning", *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"flexengine serve exited with {proc.returncode}; log: {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"flexengine serve not ready after 600 s; log: {log_path}")


def run_lm_eval(model: str, model_args: str, out: str, extra: list[str]) -> None:
    cmd = ["lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK, "--include_path", TASK_DIR,
           "--log_samples", "--output_path", out, *extra]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


def read_run(out: str) -> tuple[dict, dict]:
    """(doc_id → [loglikelihood of each choice], task metrics) from one lm_eval --output_path."""
    samples = glob.glob(os.path.join(out, "**", f"samples_{TASK}_*.jsonl"), recursive=True)
    results = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    assert len(samples) == 1 and len(results) == 1, (samples, results)
    lls = {}
    with open(samples[0]) as f:
        for line in f:
            s = json.loads(line)
            lls[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]  # resps: per choice [[loglik, is_greedy]]
    with open(results[0]) as f:
        metrics = json.load(f)["results"][TASK]
    return lls, metrics


def compare(server: dict, m_server: dict, hf: dict, m_hf: dict, tol: float) -> bool:
    assert server.keys() == hf.keys(), "the runs scored different documents"
    print(f"\n{'doc':>4} {'choice':>6} {'flexengine serve':>17} {'transformers':>13} {'|Δ|':>9}")
    worst = 0.0
    for doc in sorted(server):
        assert len(server[doc]) == len(hf[doc])
        for i, (a, b) in enumerate(zip(server[doc], hf[doc])):
            worst = max(worst, abs(a - b))
            print(f"{doc:>4} {i:>6} {a:>17.5f} {b:>13.5f} {abs(a - b):>9.2e}")
    picks_server = {d: max(range(len(v)), key=v.__getitem__) for d, v in server.items()}
    picks_hf = {d: max(range(len(v)), key=v.__getitem__) for d, v in hf.items()}
    same_picks = sum(picks_server[d] == picks_hf[d] for d in server)
    print(f"\nrequests: {sum(map(len, server.values()))} loglikelihoods over {len(server)} questions")
    print(f"max |Δ loglikelihood|: {worst:.3e} (tolerance {tol:g})")
    print(f"same choice picked: {same_picks}/{len(server)}")
    for name in ("acc,none", "acc_norm,none"):
        print(f"{name.split(',')[0]:>8}: flexengine serve {m_server[name]:.4f}   transformers {m_hf[name]:.4f}")
    same_acc = all(m_server[n] == m_hf[n] for n in ("acc,none", "acc_norm,none"))
    return worst <= tol and same_acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where lm_eval writes its samples (default: a new temp dir)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="prompts per /v1/completions request from lm-eval (a list of token-id lists)")
    ap.add_argument("--tol", type=float, default=2e-2, help="largest |Δ loglikelihood| that passes (issue 20)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra `flexengine serve` argument, repeatable (e.g. --serve-arg=--attention-backend "
                         "--serve-arg=reference)")
    args = ap.parse_args()
    from flexengine.models.default_model import named_model_path

    workdir = args.workdir or tempfile.mkdtemp(prefix="lm-eval-parity-")
    os.makedirs(workdir, exist_ok=True)
    gguf = named_model_path(MODEL)  # fetched into the cache on first use
    tokenizer = save_tokenizer(gguf, os.path.join(workdir, "tokenizer"))

    port = free_port()
    server = start_server(port, os.path.join(workdir, "serve.log"), args.serve_arg)
    try:
        run_lm_eval("local-completions",
                    f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={tokenizer},"
                    "tokenizer_backend=huggingface,max_retries=1",
                    os.path.join(workdir, "serve"), ["--batch_size", str(args.batch_size)])
    finally:
        server.terminate()
        server.wait(timeout=60)
    gguf_dir, gguf_file = os.path.split(gguf)
    run_lm_eval("hf", f"pretrained={gguf_dir},gguf_file={gguf_file},dtype=float32",
                os.path.join(workdir, "hf"), ["--device", "cpu", "--batch_size", str(args.batch_size)])

    ok = compare(*read_run(os.path.join(workdir, "serve")), *read_run(os.path.join(workdir, "hf")), args.tol)
    print(f"\nlm_eval outputs: {workdir}\n{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
