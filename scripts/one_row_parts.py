"""Issue 16: which of the one-row kernels (layers/gemv.py) pays at batch 1, measured in the engine.

The engine's one-row path (`FLEXENGINE_ONE_ROW_GEMV=on`, the default) puts these on the Triton GEMV: the residual
sum and RMSNorm folded into q/k/v and gate/up ("norm"), SiLU's gating as gate/up's epilogue ("silu", which rides on
"norm"), the LM head ("head"), the attention's output projection ("o") and the down projection ("down"), each GEMV
reading its first weight tile before programmatic dependent launch's wait ("prefetch"; "prefetch2" reads two, which
the engine does not). "rows" (not in the engine yet either) sets layers/gemv.py's FEW_ROWS to 32, so that batches
of 2-32 run their plain projections (q/k/v, gate/up, o, down, the LM head) on its few-rows kernel, for `--batch-size`
8 or 32. "rope" (in the engine since session 25: ROPE_EPILOGUE) has q/k/v's kernel apply rotary and store K/V into
the cache itself (norm_gemv_rope). This runs `flexengine bench latency` with only the named parts; the others take
the ordinary path (cuBLAS and Inductor's kernels):

    python3 scripts/one_row_parts.py norm,silu,head,o,down,prefetch -- --model DIR --max-model-len 4096 ...

Session 23 timed SiLU's gating folded into the down projection's prologue instead: it lost 0.076 ms a step
(docs/benchmarks.md).
"""
from __future__ import annotations

import sys

import torch.nn.functional as F

PARTS = ("norm", "silu", "head", "o", "down", "prefetch", "prefetch2", "rows", "rope")


def use_only(parts: set[str]) -> None:
    from flexengine.layers import gemv as G
    from flexengine.models import decoder
    from flexengine.parallel import layers
    G.PREFETCH = 2 if "prefetch2" in parts else int("prefetch" in parts)
    G.FEW_ROWS = 32 if "rows" in parts else 0
    G.ROPE_EPILOGUE = "rope" in parts
    init = decoder.DecoderLayer.__init__

    def without_parts(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "norm" not in parts:
            self.fold_qkv = self.fold_mlp = False
        self.self_attn.o_proj.plain = "o" not in parts
        self.mlp.down_proj.plain = "down" not in parts
    decoder.DecoderLayer.__init__ = without_parts
    forward = layers.RowParallelLinear.forward
    layers.RowParallelLinear.forward = lambda self, x: (F.linear(x, self.weight, self.bias) if self.plain
                                                        else forward(self, x))
    if "silu" not in parts:
        def one_row(self, x, h, norm):
            act = decoder.norm_gemv(x, h, None, norm.weight, self.gate_up_proj.weight, norm.eps)[0]
            return self.down_proj(self.act(act))
        decoder.DecoderMLP.one_row = one_row
    if "head" not in parts:
        decoder.gemv = lambda x, w, float32=False: F.linear(x, w)  # compute_logits' only use; it converts after


def main() -> int:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    parts = set(filter(None, ",".join(sys.argv[1:split]).split(",")))
    if not parts <= set(PARTS):
        raise SystemExit(f"unknown parts {sorted(parts - set(PARTS))}: choose from {PARTS}")
    use_only(parts)
    print(f"# one-row parts: {sorted(parts) or 'none'}", flush=True)
    from flexengine.cli import main as cli
    return cli(["bench", "latency", *sys.argv[split + 1:]])


if __name__ == "__main__":
    sys.exit(main())
