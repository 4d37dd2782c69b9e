"""Draw docs/benchmarks.png from the measured result JSONs in docs/results/.

Needs matplotlib (not a flexengine requirement: `pip install matplotlib`).

    python scripts/plot_benchmarks.py [--results docs/results] [--out docs/benchmarks.png]

Panels: (a) attention microbenchmark, SDPA-flash time / flex time per case at
page 128 and page 16; (b) end-to-end output tok/s, transformers generate_batch
vs flexengine; (c) batch-1 decode ms/token vs the weight-read floor and target.
"""
import argparse
import json
import os

TITLE = "H100 80GB, torch 2.11.0+cu130"
THROUGHPUT_TARGET = 30_000  # output tok/s
LATENCY_TARGET_MS = 1.1  # batch-1 decode ms/token


def load(results, name):
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def plot_attention(ax, att):
    rows = att["rows"]
    labels = [f"{r['kind']} {r['B']}x{r['ctx']}" for r in rows]
    ys = range(len(rows))
    h = 0.38
    ax.barh([y - h / 2 for y in ys], [r["sdpa"] / r["flex_p128"] for r in rows], h, label="flex page 128")
    ax.barh([y + h / 2 for y in ys], [r["sdpa"] / r["flex_p16"] for r in rows], h, label="flex page 16")
    ax.axvline(1.0, color="k", ls="--", lw=1, label="SDPA flash")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("SDPA flash time / flex time (>1: flex faster)")
    ax.set_title(f"(a) attention vs SDPA flash\n{TITLE}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")


def plot_throughput(ax, cmp):
    rows = cmp["rows"]
    names = ["transformers\ngenerate_batch" if r["engine"].startswith("transformers") else "flexengine\n(graphs)"
             for r in rows]
    vals = [r["output_tok_s"] for r in rows]
    bars = ax.bar(names, vals, color=["tab:gray", "tab:blue"][: len(vals)])
    ax.bar_label(bars, [f"{v:,.0f}" for v in vals], fontsize=8)
    ax.axhline(THROUGHPUT_TARGET, color="tab:red", ls="--", lw=1, label=f"target {THROUGHPUT_TARGET:,} tok/s")
    ax.set_yscale("log")
    ax.set_ylim(500, THROUGHPUT_TARGET * 3)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    ax.yaxis.set_minor_formatter(lambda v, _: "")
    ax.set_ylabel("output tok/s (log)")
    shape = f"{rows[0]['prompts']} prompts x {cmp['input_len']} in x {cmp['output_len']} out"
    ax.set_title(f"(b) end-to-end, {shape}\n{TITLE}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def plot_latency(ax, lat):
    names = ["weight-read\nfloor", "flexengine\n(graphs)", "transformers\nstatic cache*"]
    vals = [lat["floor_ms"], lat["ms_per_token"], lat["transformers_static_cache_ms_per_token"]]
    bars = ax.bar(names, vals, color=["tab:green", "tab:blue", "tab:gray"])
    ax.axhline(LATENCY_TARGET_MS, color="tab:red", ls="--", lw=1, label=f"target {LATENCY_TARGET_MS} ms", zorder=0)
    for t in ax.bar_label(bars, [f"{v:.2f}" for v in vals], fontsize=8, padding=9):
        t.set_bbox(dict(facecolor="white", edgecolor="none", pad=1))
    ax.set_ylabel("ms / token (lower is better)")
    ax.set_ylim(top=max(vals) * 1.15)
    ax.set_title(f"(c) batch-1 decode, {lat['input_len']} in x {lat['output_len']} out\n{TITLE}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.text(0.02, 0.8, "*DESIGN.md anchor, not this run", transform=ax.transAxes, fontsize=7)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="docs/results")
    p.add_argument("--out", default="docs/benchmarks.png")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    plot_attention(axes[0], load(args.results, "attention.json"))
    plot_throughput(axes[1], load(args.results, "compare_transformers.json"))
    plot_latency(axes[2], load(args.results, "latency.json"))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
