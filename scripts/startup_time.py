"""Start-up of an engine as a fresh box sees it: Inductor's, Triton's and FA4's caches point at new, empty folders.

    python scripts/startup_time.py --model DIR [--dtype bfloat16] [engine flags ...]

Prints the time from `LLM(...)` to a built engine; the engine's own log splits it (load, KV sizing, warm-up, decode
graphs per bucket, graphs for steps with prompts), then dynamo's compile seconds by phase. `--cache-dir DIR` keeps
the caches in DIR instead (run twice: a first start on a fresh box, then a second start on the same box).
`--sample-stacks` samples the main thread's stack every 20 ms during the build and prints where the wall time went
(each function's inclusive share, and a coarse split: dynamo tracing, Inductor, Triton, FA4's CuTe JIT, CUDA), and
the Triton kernels compiled in this process by seconds. Inductor compiles most of them in worker processes, which
neither list sees; `TORCHINDUCTOR_COMPILE_THREADS=1` compiles them all here, one after another (a slower start, for
the diagnosis only: which kernels a fresh box waits for, e.g. one flex kernel per prefill bucket).
Issue 24's bar: at most 60 s at the default max_model_len on the H100.
"""
import argparse
import collections
import os
import sys
import tempfile
import threading
import time

# coarse buckets for --sample-stacks, first match from the innermost frame out
STAGES = (("fa4 cute jit", ("cutlass", "flash_attn/cute")), ("triton compile", ("triton/compiler", "triton/backends")),
          ("inductor", ("torch/_inductor",)), ("dynamo trace", ("torch/_dynamo", "torch/fx", "torch/_subclasses")),
          ("aot autograd", ("torch/_functorch",)), ("cuda graphs", ("torch/cuda/graphs",)))
# start-up's phases: the outermost of these functions on the stack names a sample's phase
PHASES = ("measure_num_blocks", "warm_up_steps", "capture_decode_graphs", "capture_mixed_graphs")


COMPILES = collections.defaultdict(list)  # what -> seconds of each call
KERNELS = collections.defaultdict(list)  # Triton kernel name -> seconds of each of its compiles in this process
FA4_KEYS = []  # the compile key of each FA4 kernel compiled (flash_attn.cute.interface's local `compile_key`)


def time_compiles() -> None:
    """Time each call of CuTe's compile (FA4's kernels) and of Triton's in this process (not Inductor's workers')."""
    def timed(what, fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            caller = sys._getframe(1)
            if "compile_key" in caller.f_locals:
                FA4_KEYS.append((caller.f_code.co_name, caller.f_locals["compile_key"]))
            try:
                return fn(*args, **kwargs)
            finally:
                COMPILES[what].append(time.perf_counter() - started)
                if what.startswith("triton") and args:
                    KERNELS[getattr(args[0], "name", "?")].append(COMPILES[what][-1])
        return run
    try:
        import cutlass.cute as cute
        cute.compile = timed("cute.compile", cute.compile)
    except ImportError:
        pass
    import triton
    import triton.compiler.compiler as triton_compiler
    triton_compiler.compile = triton.compile = timed("triton.compile (main process)", triton_compiler.compile)
    import triton.runtime.build as triton_build  # the C builds (gcc): Triton's kernel launchers, in any thread here
    if hasattr(triton_build, "_build"):
        triton_build._build = timed("C builds (Triton's launchers)", triton_build._build)


class StackSampler(threading.Thread):
    """Every `period` s, the main thread's stack: counts per function (inclusive, each once a sample) and per
    coarse stage (the innermost frame's package that STAGES names), and per innermost frame beside its nearest caller
    in Inductor (what a stage's time is: a Triton compile in the main thread, and who asked for it)."""

    def __init__(self, period: float = 0.02):
        super().__init__(daemon=True)
        self.period, self.main, self.stop = period, threading.main_thread().ident, threading.Event()
        self.functions, self.stages, self.samples = collections.Counter(), collections.Counter(), 0
        self.by_phase = collections.Counter()  # (phase, stage) -> samples
        self.innermost = collections.Counter()  # (stage, innermost frame, nearest torch/_inductor frame) -> samples

    def run(self) -> None:
        while not self.stop.wait(self.period):
            frame = sys._current_frames().get(self.main)
            names, stage, phase, inner, caller = set(), None, "other", None, None
            while frame is not None:
                code = frame.f_code
                path = code.co_filename.replace("\\", "/")
                here = f"{path.rsplit('site-packages/', 1)[-1]}:{code.co_name}"
                inner = inner or here
                if caller is None and "torch/_inductor" in path:
                    caller = here
                if stage is None:
                    stage = next((s for s, keys in STAGES if any(k in path for k in keys)), None)
                if code.co_name in PHASES:
                    phase = code.co_name
                names.add(here)
                frame = frame.f_back
            self.samples += 1
            self.functions.update(names)
            self.stages[stage or "other"] += 1
            self.by_phase[phase, stage or "other"] += 1
            self.innermost[stage or "other", inner, caller] += 1

    def report(self, top: int = 60) -> str:
        n = max(self.samples, 1)
        lines = [f"{self.samples} samples of {self.period * 1e3:.0f} ms; by stage (innermost frame):"]
        lines += [f"  {s:16s} {c * self.period:7.1f} s  {c / n:6.1%}" for s, c in self.stages.most_common()]
        lines.append("by phase and stage:")
        for phase in (*PHASES, "other"):
            cells = sorted(((c, st) for (ph, st), c in self.by_phase.items() if ph == phase), reverse=True)
            total = sum(c for c, _ in cells)
            lines.append(f"  {phase:22s} {total * self.period:6.1f} s: "
                         + ", ".join(f"{st} {c * self.period:.1f}" for c, st in cells))
        lines.append("innermost frames (stage, frame, its nearest Inductor caller), top 25:")
        lines += [f"  {c * self.period:7.1f} s  {st}: {f}  <- {cl}" for (st, f, cl), c in self.innermost.most_common(25)]
        lines.append(f"functions by inclusive share (top {top}):")
        lines += [f"  {c * self.period:7.1f} s {c / n:6.1%}  {f}" for f, c in self.functions.most_common(top)]
        return "\n".join(lines)


def kernel_report(top: int = 30) -> str:
    """The Triton kernels compiled in this process, most seconds first: name, compiles, seconds."""
    rows = sorted(KERNELS.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"Triton kernels compiled in this process: {sum(map(len, KERNELS.values()))} compiles of {len(KERNELS)} "
             f"names, {sum(map(sum, KERNELS.values())):.1f} s (top {top}):"]
    lines += [f"  {sum(t):6.1f} s  {len(t):3d}x  {name}" for name, t in rows[:top]]
    return "\n".join(lines)


def graph_report() -> str:
    """Each dynamo graph compiled, by function: graphs, seconds in all, and of them the backend's (AOT + Inductor,
    with the Triton compiles it waited for) and dynamo's own tracing (the rest)."""
    import torch._dynamo.utils as dynamo_utils
    by_fn = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for m in dynamo_utils.get_compilation_metrics():
        row = by_fn[f"{m.co_name} ({os.path.basename(m.co_filename or '?')})"]
        row[0] += 1
        row[1] += m.entire_frame_compile_time_s or 0.0
        row[2] += m.backend_compile_time_s or 0.0
    lines = ["dynamo graphs by function: graphs, seconds, of which backend (AOT + Inductor + Triton) and tracing:"]
    for name, (n, total, backend) in sorted(by_fn.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {total:6.1f} s  {n:3d}x  backend {backend:5.1f} s  tracing {total - backend:5.1f} s  {name}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", help="Inductor's and Triton's caches here (default: a fresh, empty folder)")
    p.add_argument("--sample-stacks", action="store_true", help="print where the build's wall time went")
    p.add_argument("--prefill-per-bucket", action="store_true",
                   help="the Triton prefill call compiled per tile bucket (flex_kernels.PREFILL_DYNAMIC off; the default "
                   "compiles it once for a symbolic tile count)")
    p.add_argument("--decode-symbolic", action="store_true",
                   help="unsplit decode rows as query heads as rows, compiled once for a symbolic row count "
                   "(flex_kernels.DECODE_DYNAMIC)")
    p.add_argument("--late-compile-workers", action="store_true",
                   help="Inductor's compile workers started at its first compile, as Inductor does (the engine starts "
                   "them before loading the weights: compile.start_compile_workers)")
    p.add_argument("--optimised-launchers", action="store_true",
                   help="Triton's C launchers built with its own -O3 (the engine builds them with -O0: "
                   "compile.unoptimised_launcher_builds)")
    p.add_argument("--knobs", default="", metavar="KEY=INT,...",
                   help="engine knobs as scripts/decode_step_probe.py takes them, e.g. down_split_rows=0 (no graph "
                   "either side of the row count) or zero_first_deltas=1 (the first layer on the later layers' graphs)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set before torch is imported, for this start and Inductor's compile workers (repeatable), "
                   "e.g. TRITON_DISABLE_LINE_INFO=1: Triton's kernels compiled without line info")
    known, rest = p.parse_known_args()
    extra_env = {}
    for pair in known.env:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            p.error(f"--env takes KEY=VALUE, not {pair!r}")
        extra_env[key] = value
    os.environ.update(extra_env)
    root = known.cache_dir or tempfile.mkdtemp(prefix="startup_")
    warm = os.path.isdir(os.path.join(root, "inductor"))
    # before torch is imported: Inductor and Triton read these once
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = os.path.join(root, "fa4")  # FA4's compiled kernels too
    from flexengine.attention.backends import flex_kernels
    from flexengine.benchmarks.common import add_engine_arguments, build_llm
    if known.prefill_per_bucket:
        flex_kernels.PREFILL_DYNAMIC = False
    if known.decode_symbolic:
        flex_kernels.DECODE_DYNAMIC = True
    from flexengine.engine import model_runner
    if known.late_compile_workers:
        model_runner.start_compile_workers = lambda: None
    if known.optimised_launchers:
        model_runner.unoptimised_launcher_builds = lambda: None
    if known.knobs:
        import decode_step_probe  # (this script's folder is on the path)
        decode_step_probe.apply(*decode_step_probe.parse(known.knobs))
    q = argparse.ArgumentParser()
    add_engine_arguments(q)
    args = q.parse_args(rest)
    sampler = StackSampler() if known.sample_stacks else None
    if sampler:
        time_compiles()
        sampler.start()
    llm, built = build_llm(args)
    if sampler:
        sampler.stop.set()
        sampler.join()
    caches = f"caches in {root}, {'warm' if warm else 'empty'} at start"
    env = {k: v for k, v in os.environ.items() if k.startswith("FLEXENGINE_")}
    env.update(extra_env)
    print(f"LLM built in {built:.1f} s ({caches}; max_model_len {llm.llm_engine.max_model_len}; env {env})",
          flush=True)
    import torch._dynamo.utils as dynamo_utils
    print("dynamo/inductor compile seconds by phase (summed over every compile):", flush=True)
    print(dynamo_utils.compile_times(repr="str", aggregate=True), flush=True)
    print("dynamo counters:", {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("stats", "frames")},
          flush=True)
    print(graph_report(), flush=True)
    if sampler:
        for what, seconds in COMPILES.items():
            print(f"{what}: {len(seconds)} calls, {sum(seconds):.1f} s (longest {max(seconds):.1f} s)", flush=True)
        first = FA4_KEYS[0][1] if FA4_KEYS else ()
        for i, (fn, key) in enumerate(FA4_KEYS):  # the first in full, the others where they differ from it
            shown = key if i == 0 else {j: v for j, v in enumerate(key) if j >= len(first) or v != first[j]}
            print(f"FA4 compile {i} ({fn}): {shown}", flush=True)
        print(kernel_report(), flush=True)
        print(sampler.report(), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
