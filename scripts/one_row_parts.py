"""Issue 16: which of the one-row kernels (layers/gemv.py) pays at batch 1, measured in the engine.

`FLEXENGINE_ONE_ROW_GEMV=on` (the default) puts two things on the Triton GEMV: the residual sum and RMSNorm folded
into q/k/v and gate/up ("norm"), and the LM head ("head"). This runs `flexengine bench latency` with only the named
parts kept; the others take the ordinary path (cuBLAS and Inductor's kernels):

    python3 scripts/one_row_parts.py norm -- --model DIR --max-model-len 4096 ...

Session 23 timed a third part here, SiLU's gating folded into the down projection: it lost 0.076 ms a step and
was removed (docs/benchmarks.md).

The parts are removed by replacing the decoder's hooks before the engine is built, so that the compiled regions
and graphs never see them; everything after `--` goes to `flexengine bench latency`.
"""
from __future__ import annotations

import sys

import torch.nn.functional as F

PARTS = ("norm", "head")


def keep_only(parts: set[str]) -> None:
    from flexengine.models import decoder
    if "norm" not in parts:
        init = decoder.DecoderLayer.__init__

        def no_norm_fold(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.fold_qkv = self.fold_mlp = False
        decoder.DecoderLayer.__init__ = no_norm_fold
    if "head" not in parts:
        decoder.gemv = F.linear


def main() -> int:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    parts = set(filter(None, ",".join(sys.argv[1:split]).split(",")))
    if not parts <= set(PARTS):
        raise SystemExit(f"unknown parts {sorted(parts - set(PARTS))}: choose from {PARTS}")
    keep_only(parts)
    print(f"# one-row parts kept: {sorted(parts) or 'none'}", flush=True)
    from flexengine.cli import main as cli
    return cli(["bench", "latency", *sys.argv[split + 1:]])


if __name__ == "__main__":
    sys.exit(main())
