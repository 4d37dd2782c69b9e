"""What one tensor-parallel sum costs inside a CUDA graph on two GPUs (issue 23): flexengine's one-shot kernel
(parallel/one_shot.py), torch's symmetric-memory op and NCCL, between the projections of the 8B shape at TP=2.

    python3 scripts/all_reduce_probe.py [--rows 1,8,32] [--sums 64] [--replays 50]

Each rank captures a graph of `--sums` iterations of (o projection [rows, 2048] → [rows, 4096], the sum, a
[4096] → [2048] projection back), one graph per method, and times its replays; "none" is the same graph without
the sums, so a method's µs per sum is (its graph − none's) / sums. The projections are layers/gemv.py's at one row
(PDL), cuBLAS above. Before timing, each method's sum of one input is checked against NCCL's.
"""
from __future__ import annotations

import argparse

import torch
import torch.multiprocessing as mp

from flexengine.parallel.launch import free_port


def rank_main(rank: int, port: int, args, queue) -> None:
    try:
        queue.put((rank, measure(rank, port, args)))
    except BaseException as e:  # reported, so that the parent stops the other rank instead of waiting on it
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise


def measure(rank: int, port: int, args) -> list:
    import torch.distributed as dist
    import torch.nn.functional as F

    from flexengine.layers.gemv import gemv
    from flexengine.parallel import one_shot
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=device)
    group, dtype = dist.group.WORLD, torch.bfloat16
    one_shot.enable(group, dtype, device, own=True)
    torch_buffer, name = one_shot._torch_op
    g = torch.Generator(device="cuda").manual_seed(rank)
    w_out = torch.randn(4096, 2048, device=device, dtype=dtype, generator=g) * 0.02  # o_proj's shard
    w_in = torch.randn(2048, 4096, device=device, dtype=dtype, generator=g) * 0.02   # back to the shard's width

    def nccl(y):
        dist.all_reduce(y, group=group)
        return y

    methods = {"none": lambda y: y, "flexengine": one_shot._launch,
               "torch": lambda y: torch.ops.symm_mem.one_shot_all_reduce_copy(torch_buffer[: y.numel()].view(y.shape),
                                                                              y, "sum", name),
               "nccl": nccl}
    rows_out = []
    for rows in args.rows:
        project = gemv if rows == 1 else (lambda h, w: F.linear(h, w))
        x = torch.randn(rows, 2048, device=device, dtype=dtype, generator=g)
        probe = torch.randn(rows, 4096, device=device, dtype=dtype, generator=g)
        want = nccl(probe.clone())
        for method, sum_ in methods.items():
            if method != "none":
                got = sum_(probe.clone())
                assert torch.equal(got, want), (method, rows, (got.float() - want.float()).abs().max().item())

            def iterations():
                h = x
                for _ in range(args.sums):
                    h = project(sum_(project(h, w_out)), w_in)
                return h

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    iterations()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                iterations()
            dist.barrier(group)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.replays)
            rows_out.append((rows, method, sorted(times)[1]))
            del graph
    one_shot.disable()
    dist.destroy_process_group()
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32", type=lambda s: [int(r) for r in s.split(",")])
    parser.add_argument("--sums", type=int, default=64)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    print(f"# {torch.cuda.device_count()} x {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    port = free_port()
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, port, args, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = {}
    while len(results) < 2:
        rank, got = queue.get(timeout=240)
        if isinstance(got, str):
            for p in ranks:
                p.kill()
            raise SystemExit(f"rank {rank} failed: {got}")
        results[rank] = got
    for p in ranks:
        p.join(timeout=60)
    print("| rows | method | µs per graph replay, rank 0 / rank 1 (median of 3 timings) | µs per sum (rank 0) |")
    print("|---|---|---|---|")
    base = {(rows, r): t for r in (0, 1) for rows, method, t in results[r] if method == "none"}
    for (rows, method, t0), (_, _, t1) in zip(results[0], results[1]):
        per_sum = "" if method == "none" else f"{(t0 - base[rows, 0]) / args.sums:.2f}"
        print(f"| {rows} | {method} | {t0:.1f} / {t1:.1f} | {per_sum} |")


if __name__ == "__main__":
    main()
