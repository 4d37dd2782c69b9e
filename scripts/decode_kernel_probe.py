"""Issue 16 / 15: flex's decode kernel with other tile options (attention/backends/flex.py's DECODE_OPTIONS), in
`flexengine bench latency` or the attention microbenchmark:

    python3 scripts/decode_kernel_probe.py num_stages=3,num_warps=4 -- latency --model DIR --batch-size 32 ...
    python3 scripts/decode_kernel_probe.py BLOCK_N=128,num_stages=2 -- attention --decode-only
    python3 scripts/decode_kernel_probe.py none -- latency ...      # flex's own choice (the engine's before session 25)

torch 2.11 gives sm90's decode template one pipeline stage, two warps and a 64-wide KV tile; the H100's batch-32
profile (session 25) had that kernel at 20 µs a layer for ~300-token contexts, where batch 8 with four splits took 8.5.
The engine now asks for three stages there (flex.default_decode_options).
"""
from __future__ import annotations

import sys

KEYS = ("BLOCK_N", "num_stages", "num_warps")


def parse(text: str) -> dict:
    options = {}
    for item in filter(None, text.split(",")):
        if item == "none":
            continue
        key, _, value = item.partition("=")
        if key not in KEYS or not value.isdigit():
            raise SystemExit(f"bad option {item!r}: KEY=INT with KEY one of {KEYS}")
        options[key] = int(value)
    return options


def main() -> int:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    options = parse(",".join(sys.argv[1:split]))
    what, *args = sys.argv[split + 1:] or ["latency"]
    from flexengine.attention.backends import flex
    flex.DECODE_OPTIONS = options
    print(f"# flex decode kernel options: {options or 'flex default'}", flush=True)
    if what == "attention":
        import argparse
        from flexengine.benchmarks import attention
        parser = argparse.ArgumentParser()
        attention.add_arguments(parser)
        return attention.main(parser.parse_args(args))
    if what != "latency":
        raise SystemExit(f"run 'latency' or 'attention', not {what!r}")
    from flexengine.cli import main as cli
    return cli(["bench", "latency", *args])


if __name__ == "__main__":
    sys.exit(main())
