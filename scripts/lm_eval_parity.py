"""lm-eval through `flexengine serve` against lm-eval's own transformers backend (issue 20).

One command runs EleutherAI's lm-evaluation-harness twice on the same two local tasks (tests/data/lm_eval_mc,
JSONL, no hub access: flexengine_mc, 32 multiple-choice questions; flexengine_ppl, rolling loglikelihood
over 8 passages) and the same checkpoint, SmolLM2-135M-Instruct (Q4_1 GGUF from flexengine's cache), in
float32:
  1. `--model local-completions` against `flexengine serve smollm2-135m-instruct --dtype float32`
     (flexengine dequantizes the GGUF with its own loader);
  2. `--model hf` with `gguf_file=` (transformers dequantizes the same file).
Then it pairs the loglikelihoods of both runs' --log_samples (per choice; per passage) and prints a table,
the largest |Δ loglikelihood| and both runs' metrics. Exit status 1 when |Δ| passes --tol or the
accuracies differ.

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
TASKS = ("flexengine_mc", "flexengine_ppl")  # 32 questions; 8 passages scored in rolling windows
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
    cmd = ["lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", TASK_DIR, "--log_samples", "--output_path", out, *extra]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


def read_run(out: str) -> tuple[dict, dict]:
    """From one lm_eval --output_path: {task: {doc_id: [loglikelihood of each request]}} and {task: metrics}.
    A multiple-choice doc has one request per choice (resps [[loglik, is_greedy]] each); a rolling one has
    a single value, the sum over its windows."""
    results = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    assert len(results) == 1, results
    with open(results[0]) as f:
        metrics = json.load(f)["results"]
    lls = {}
    for task in TASKS:
        samples = glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True)
        assert len(samples) == 1, samples
        lls[task] = {}
        with open(samples[0]) as f:
            for line in f:
                s = json.loads(line)
                lls[task][s["doc_id"]] = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in s["resps"]]
    return lls, metrics


def compare(server: dict, m_server: dict, hf: dict, m_hf: dict, tol: float) -> bool:
    print(f"\n{'task':<15} {'doc':>4} {'req':>4} {'flexengine serve':>17} {'transformers':>13} {'|Δ|':>9}")
    worst, requests = 0.0, 0
    for task in TASKS:
        assert server[task].keys() == hf[task].keys(), f"{task}: the runs scored different documents"
        for doc in sorted(server[task]):
            assert len(server[task][doc]) == len(hf[task][doc])
            for i, (a, b) in enumerate(zip(server[task][doc], hf[task][doc])):
                worst, requests = max(worst, abs(a - b)), requests + 1
                print(f"{task:<15} {doc:>4} {i:>4} {a:>17.5f} {b:>13.5f} {abs(a - b):>9.2e}")
    mc = server[TASKS[0]]
    same_picks = sum(max(range(len(v)), key=v.__getitem__) == max(range(len(w)), key=w.__getitem__)
                     for v, w in zip(mc.values(), (hf[TASKS[0]][d] for d in mc)))
    print(f"\n{requests} scores compared; max |Δ loglikelihood|: {worst:.3e} (tolerance {tol:g})")
    print(f"{TASKS[0]}: same choice picked on {same_picks}/{len(mc)} questions")
    print(f"\n{'metric':<32} {'flexengine serve':>17} {'transformers':>13}")
    for task in TASKS:
        for name in sorted(k for k, v in m_hf[task].items() if "stderr" not in k and isinstance(v, (int, float))):
            print(f"{task + ' ' + name.split(',')[0]:<32} {m_server[task][name]:>17.4f} {m_hf[task][name]:>13.4f}")
    same_acc = all(m_server[TASKS[0]][n] == m_hf[TASKS[0]][n] for n in ("acc,none", "acc_norm,none"))
    return worst <= tol and same_acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where lm_eval writes its samples (default: a new temp dir)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="prompts per /v1/completions request from lm-eval (a list of token-id lists)")
    ap.add_argument("--max-length", type=int, default=24,
                    help="tokens per rolling window of flexengine_ppl (its passages are 35-47 tokens: two windows each)")
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

    # lm-eval cuts rolling windows of max_length - 2 tokens for an API model (one for the token it
    # generates, one for the context) and of max_length for hf: the server's run gets 2 more, so both
    # score the same windows.
    port = free_port()
    server = start_server(port, os.path.join(workdir, "serve.log"), args.serve_arg)
    try:
        run_lm_eval("local-completions",
                    f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={tokenizer},"
                    f"tokenizer_backend=huggingface,max_retries=1,max_length={args.max_length + 2}",
                    os.path.join(workdir, "serve"), ["--batch_size", str(args.batch_size)])
    finally:
        server.terminate()
        server.wait(timeout=60)
    gguf_dir, gguf_file = os.path.split(gguf)
    run_lm_eval("hf", f"pretrained={gguf_dir},gguf_file={gguf_file},dtype=float32,max_length={args.max_length}",
                os.path.join(workdir, "hf"), ["--device", "cpu", "--batch_size", str(args.batch_size)])

    ok = compare(*read_run(os.path.join(workdir, "serve")), *read_run(os.path.join(workdir, "hf")), args.tol)
    print(f"\nlm_eval outputs: {workdir}\n{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
