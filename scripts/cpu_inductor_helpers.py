"""The CUDA engine's compiled helpers (take_decode_inputs: take_inputs and the decode positions; the decode page
lists) built by Inductor on the CPU, in the CPU engine's run of the CUDA path (tests/conftest.py's gpu_shaped_engines:
dynamo's eager backend for everything else): a change to how they are traced fails here as it would on a GPU box,
without one. Run it under the GPU boxes' torch too (a venv with `pip install torch==2.11.0`: session 47's
backed_size_oblivious lowered on 2.13 and not on 2.11). torch 2.11's C++ backend fails on take_inputs as it stands
(`'tmp5' was not declared`, a CPU code generation bug: the GPU compiles it), so under 2.11 check the page lists.

    python3 scripts/cpu_inductor_helpers.py [take_decode_inputs,decode_lists]

Prints each helper's graph count after an engine's warm-up (buckets 1-16) and whether its tokens are the eager
engine's.
"""
import argparse
import os
import sys

import pytest
import torch

REAL_COMPILE = torch.compile  # (before the fixture swaps it for the eager backend's)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from conftest import gpu_shaped_engines
    from harness import decode_graph_helpers
    from flexengine import LLM, SamplingParams
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("helpers", nargs="?", default="take_decode_inputs,decode_lists")
    args = p.parse_args()
    helpers = decode_graph_helpers()
    env = pytest.MonkeyPatch()
    fixture = gpu_shaped_engines.__wrapped__(env)
    next(fixture)
    plain = {}
    for name in args.helpers.split(","):
        module, compiled = helpers[name]
        plain[name] = getattr(module, name)
        with pytest.MonkeyPatch.context() as real:
            real.setattr(torch, "compile", REAL_COMPILE)
            compiled.cache_clear()
            fn = compiled()
        env.setattr(module, name, fn)  # (the CPU's call sites take the plain function)
    config = dict(max_num_seqs=16, max_num_batched_tokens=640, num_kv_blocks=96, max_model_len=128)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = LLM(**config).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for name, fn in plain.items():
        print(f"{name}: {len(_debug_get_cache_entry_list(fn.__code__))} graphs")
    env.undo()
    expected = LLM(**config, enforce_eager=True).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)
    same = [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    print(f"torch {torch.__version__}: tokens {'equal to' if same else 'DIFFER from'} the eager engine's")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
