"""`flexengine generate | chat | bench | serve | make-model`.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `main(args)`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("flexengine.generate", "generate text for prompts with the offline engine"),
    "serve": ("flexengine.server.api_server", "run the OpenAI-compatible HTTP server"),
    "make-model": ("flexengine.models.presets", "write a random checkpoint of a real model's shape, or fetch a "
                                                 "real one (smollm2-135m-instruct)"),
    "chat": ("flexengine.chat_repl", "chat with a model in the terminal (streamed replies, Ctrl-D quits)"),
}
BENCH_COMMANDS = {
    "throughput": ("flexengine.benchmarks.throughput", "offline throughput (vLLM's benchmark_throughput)"),
    "latency": ("flexengine.benchmarks.latency", "per-token decode latency at a fixed batch size"),
    "serve": ("flexengine.benchmarks.serve", "serving benchmark against an OpenAI-compatible URL"),
    "attention": ("flexengine.benchmarks.attention", "paged attention microbenchmark vs SDPA"),
    "long-context": ("flexengine.benchmarks.long_context", "long-prompt prefill vs transformers' forward"),
}


# Commands whose dependencies come with an extra: a missing one is a line saying which, not a traceback.
EXTRAS = {"flexengine.server.api_server": "serve"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None (there the help says what None means)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add(sub, name, module, help_text, chosen: bool):
    parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
    if chosen:  # import only the module that runs, so `flexengine generate` never pays for the server
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if module not in EXTRAS or e.name is None or e.name.startswith("flexengine"):
                raise
            print(f"flexengine {name} needs the {EXTRAS[module]} extra, which is not installed (no module "
                  f"{e.name!r}): pip install 'flexengine[{EXTRAS[module]}]'", file=sys.stderr)
            raise SystemExit(2) from None
        mod.add_arguments(parser)
        parser.set_defaults(_main=mod.main)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text, chosen=wanted == name)
    bench = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_text) in BENCH_COMMANDS.items():
        _add(bench_sub, name, module, help_text, chosen=wanted_bench == name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    from .models.default_model import ModelUnavailableError, resolve_named_model
    try:
        # A named model is fetched here, in the foreground, before any command starts (serve's engine
        # process would otherwise fetch it where a failure is a traceback in another process).
        resolve_named_model(getattr(args, "model", None))
        return args._main(args) or 0
    except ModelUnavailableError as e:  # a named model that cannot be fetched: say how to get it, no traceback
        print(f"flexengine {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
