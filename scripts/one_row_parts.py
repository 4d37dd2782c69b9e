"""Issue 16: which of the one-row kernels (layers/gemv.py) pays at batch 1, measured in the engine.

The engine's one-row path (`FLEXENGINE_ONE_ROW_GEMV=on`, the default) puts three things on the Triton GEMV: the
residual sum and RMSNorm folded into q/k/v and gate/up ("norm"), SiLU's gating as gate/up's epilogue ("silu",
which rides on "norm"), and the LM head ("head"). This runs `flexengine bench latency` with only the named parts;
the others take the ordinary path (cuBLAS and Inductor's kernels). Three parts the engine does not take: "down" and
"o" put the down projection and the attention's output projection on the plain GEMV instead of cuBLAS (one model
with neither bias nor tensor parallelism), and "prefetch" has the GEMV read its first weight tile before programmatic
dependent launch's wait ("prefetch2": two; layers/gemv.py's PREFETCH; it needs FLEXENGINE_PDL=on, the default, to matter, and a GEMV
before it to overlap with, which "o" gives the gate/up projection and "down" the next layer's q/k/v):

    python3 scripts/one_row_parts.py norm,silu,head -- --model DIR --max-model-len 4096 ...

Session 23 timed SiLU's gating folded into the down projection's prologue instead: it lost 0.076 ms a step
(docs/benchmarks.md).
"""
from __future__ import annotations

import sys

import torch.nn.functional as F

PARTS = ("norm", "silu", "head", "down", "o", "prefetch", "prefetch2")


def use_only(parts: set[str]) -> None:
    from flexengine.layers import gemv as G
    from flexengine.layers.gemv import gemv
    from flexengine.models import decoder
    G.PREFETCH = 2 if "prefetch2" in parts else int("prefetch" in parts)
    if "o" in parts:
        out = decoder.DecoderAttention.out

        def o_on_gemv(self, o):
            o = o.reshape(o.shape[0], self.q_size)
            if not G.one_row(o):
                return out(self, o)
            assert self.o_proj.bias is None and self.o_proj.tp_size == 1
            return gemv(o, self.o_proj.weight)
        decoder.DecoderAttention.out = o_on_gemv
    if "norm" not in parts:
        init = decoder.DecoderLayer.__init__

        def no_norm_fold(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.fold_qkv = self.fold_mlp = False
        decoder.DecoderLayer.__init__ = no_norm_fold
    if "silu" not in parts or "down" in parts:
        def one_row(self, x, h, norm):
            gated = "silu" in parts
            act = decoder.norm_gemv(x, h, None, norm.weight, self.gate_up_proj.weight, norm.eps, gated)[0]
            act = act if gated else self.act(act)
            if "down" in parts:
                assert self.down_proj.bias is None and self.down_proj.tp_size == 1
                return gemv(act, self.down_proj.weight)
            return self.down_proj(act)
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
