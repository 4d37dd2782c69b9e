"""Start-up of an engine as a fresh box sees it: Inductor's, Triton's and FA4's caches point at new, empty folders.

    python scripts/startup_time.py --model DIR [--dtype bfloat16] [engine flags ...]

Prints the time from `LLM(...)` to a built engine; the engine's own log splits it (load, KV sizing, warm-up, decode
graphs per bucket, graphs for steps with prompts), then dynamo's compile seconds by phase. `--cache-dir DIR` keeps
the caches in DIR instead (run twice: a first start on a fresh box, then a second start on the same box).
Issue 24's bar: at most 60 s at the default max_model_len on the H100.
"""
import argparse
import os
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", help="Inductor's and Triton's caches here (default: a fresh, empty folder)")
    known, rest = p.parse_known_args()
    root = known.cache_dir or tempfile.mkdtemp(prefix="startup_")
    warm = os.path.isdir(os.path.join(root, "inductor"))
    # before torch is imported: Inductor and Triton read these once
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = os.path.join(root, "fa4")  # FA4's compiled kernels too
    from flexengine.benchmarks.common import add_engine_arguments, build_llm
    q = argparse.ArgumentParser()
    add_engine_arguments(q)
    args = q.parse_args(rest)
    llm, built = build_llm(args)
    caches = f"caches in {root}, {'warm' if warm else 'empty'} at start"
    env = {k: v for k, v in os.environ.items() if k.startswith("FLEXENGINE_")}
    print(f"LLM built in {built:.1f} s ({caches}; max_model_len {llm.llm_engine.max_model_len}; env {env})",
          flush=True)
    import torch._dynamo.utils as dynamo_utils
    print("dynamo/inductor compile seconds by phase (summed over every compile):", flush=True)
    print(dynamo_utils.compile_times(repr="str", aggregate=True), flush=True)
    print("dynamo counters:", {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("stats", "frames")},
          flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
