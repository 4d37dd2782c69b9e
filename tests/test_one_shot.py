"""The one-shot sum of tensor parallelism (parallel/one_shot.py). Its kernel on the CPU: Triton's interpreter in one
process per rank, each reading the others' buffers in shared memory as GPUs read each other's, against a plain sum;
which kernel each sum takes; and on two GPUs, the kernel against the plain sum of NCCL-gathered copies, eagerly and
replayed from a CUDA graph."""
from __future__ import annotations

import multiprocessing
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine.parallel import collectives, one_shot
from flexengine.parallel.launch import free_port

pytest.importorskip("triton")

BLOCK, PROGRAMS = 1024, 4  # the interpreted kernel's: sums up to 4 programs


def rank_sums(rank: int, world: int, buffers: list[torch.Tensor], inputs: list[torch.Tensor], queue) -> None:
    """One rank's sums, in a process of its own (TRITON_INTERPRET=1 from the parent's environment)."""
    from flexengine.parallel.one_shot_kernel import one_shot_sum_kernel
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)  # this process's address of each
    counts = torch.zeros(PROGRAMS, dtype=torch.int64)
    outs = []
    for x in inputs:
        out = torch.empty_like(x)
        one_shot_sum_kernel[(-(-x.numel() // BLOCK),)](
            x, out, table.data_ptr(), counts, x.numel(), FLAGS_BYTES=PROGRAMS * 8 * world, SLOT=PROGRAMS * BLOCK,
            RANK=rank, WORLD=world, BLOCK=BLOCK, USE_PDL=False)
        outs.append(out.tolist())
    queue.put((rank, outs, counts.tolist()))


@settings(max_examples=4, deadline=None)
@given(sizes=st.lists(st.integers(1, PROGRAMS * BLOCK), min_size=1, max_size=8), world=st.sampled_from([2, 3]),
       seed=st.integers(0, 2**16))
def test_the_kernel_sums_every_ranks_copy_under_the_interpreter(sizes, world, seed):
    """Every rank gets the float32 sum of all ranks' inputs in rank order, bit for bit, over a schedule of sums
    of different sizes (so different programs, each alternating its two slots and raising its flags); each
    program counts the sums it took part in. float32: the interpreter rounds to bfloat16 by truncation."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test below runs the kernel natively")
    g = torch.Generator().manual_seed(seed)
    inputs = [[torch.randn(n, generator=g) for n in sizes] for _ in range(world)]
    buffers = [torch.zeros(PROGRAMS * 8 * world + 2 * PROGRAMS * BLOCK * 4, dtype=torch.uint8).share_memory_()
               for _ in range(world)]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the children's triton interprets (they import it after this)
    try:
        ranks = [context.Process(target=rank_sums, args=(r, world, buffers, inputs[r], queue)) for r in range(world)]
        for p in ranks:
            p.start()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    results = dict((rank, (outs, counts)) for rank, outs, counts in (queue.get(timeout=300) for _ in ranks))
    for p in ranks:
        p.join(timeout=60)
    for i, n in enumerate(sizes):
        want = inputs[0][i].clone()
        for r in range(1, world):
            want += inputs[r][i]
        for rank in range(world):
            assert results[rank][0][i] == want.tolist(), (rank, i, n)
    for rank in range(world):
        assert results[rank][1] == [sum(n > p * BLOCK for n in sizes) for p in range(PROGRAMS)]


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_the_kernel_compiles_for_hopper_with_system_scope_atomics(dtype):
    """Triton compiles the kernel for sm90 on any machine (no GPU needed): the interpreter above does not check
    types (session 26's first GPU call failed on an int32 compare-and-swap operand of an int64 flag). The PTX holds
    PDL's launch and wait and the flags' system-scope release and acquire."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flexengine.parallel.one_shot_kernel import one_shot_sum_kernel
    constexprs = dict(FLAGS_BYTES=2048, SLOT=one_shot.MAX_PROGRAMS * one_shot.BLOCK, RANK=1, WORLD=2,
                      BLOCK=one_shot.BLOCK, USE_PDL=True)
    signature = dict(x_ptr=dtype, out_ptr=dtype, buffers="i64", count_ptr="*i64", numel="i32",
                     **{name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(fn=one_shot_sum_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    for op in ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "atom.global.sys.release.exch.b64",
               "atom.global.acquire.sys.cas.b64"):
        assert op in ptx, op


def test_small_sums_take_the_kernel_and_larger_ones_torch_s_op(monkeypatch):
    """Up to MAX_PROGRAMS * BLOCK elements in the buffers' dtype: the kernel; larger, or under torch_one_shot
    (no kernel buffers), torch's op on its buffer viewed in x's shape; past torch's buffer or in another dtype:
    NCCL (here gloo's place: dist.all_reduce)."""
    calls = []
    torch_buffer = torch.zeros(one_shot.TORCH_OP_MAX_BYTES // 2, dtype=torch.bfloat16)
    monkeypatch.setattr(one_shot, "_torch_op", (torch_buffer, "tp"))
    monkeypatch.setattr(one_shot, "_own", one_shot.Buffers(None, None, None, torch.bfloat16, 0, 2))
    monkeypatch.setattr(one_shot, "_launch", lambda x: calls.append(("kernel", tuple(x.shape))) or x * 3)
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_copy", lambda buffer, x, op, name: calls.append(
        ("torch", buffer.data_ptr(), tuple(buffer.shape), op, name)) or x * 2)
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda x, group: calls.append("nccl"))
    one_row, most = torch.ones(1, 4096, dtype=torch.bfloat16), torch.ones(16, 4096, dtype=torch.bfloat16)
    assert torch.equal(collectives.all_reduce(one_row, None), one_row * 3)
    assert torch.equal(collectives.all_reduce(most, None), most * 3)
    assert torch.equal(collectives.all_reduce(torch.ones(17, 4096, dtype=torch.bfloat16), None), 2 * torch.ones(17, 4096))
    assert calls == [("kernel", (1, 4096)), ("kernel", (16, 4096)),
                     ("torch", torch_buffer.data_ptr(), (17, 4096), "sum", "tp")]
    calls.clear()
    collectives.all_reduce(torch.ones(1025, 4096, dtype=torch.bfloat16), None)  # past 8 MiB
    collectives.all_reduce(torch.ones(8, 4096), None)  # float32: not the buffers' dtype
    monkeypatch.setattr(one_shot, "_own", None)  # FLEXENGINE_ALL_REDUCE=torch_one_shot
    collectives.all_reduce(one_row, None)
    assert calls == ["nccl", "nccl", ("torch", torch_buffer.data_ptr(), (1, 4096), "sum", "tp")]


def two_gpu_rank(rank: int, port: int, queue) -> None:
    try:
        queue.put((rank, two_gpu_sums(rank, port)))
    except BaseException as e:  # reported, so that the test stops the other rank instead of waiting on it
        queue.put((rank, [f"{type(e).__name__}: {e}"]))
        raise


def two_gpu_sums(rank: int, port: int) -> list[str]:
    """Rank `rank` of two on cuda:rank: a random schedule of sums through the kernel, eagerly and from a CUDA graph
    replayed several times on new inputs, each against the float32 sum of the NCCL-gathered inputs."""
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        errors = []
        for dtype in (torch.bfloat16, torch.float32):
            one_shot.enable(dist.group.WORLD, dtype, torch.device("cuda", rank), own=True)
            sizes = [random.Random(7).randint(1, one_shot.MAX_PROGRAMS * one_shot.BLOCK) for _ in range(12)]
            sizes += [4096, 4096, one_shot.MAX_PROGRAMS * one_shot.BLOCK, 1, 8 * 4096]
            inputs = [torch.empty(n, dtype=dtype, device="cuda") for n in sizes]

            def refill(seed):
                g = torch.Generator(device="cuda").manual_seed(seed * 2 + rank)
                for x in inputs:
                    x.normal_(generator=g)

            def check(outs, what):
                for x, out in zip(inputs, outs):
                    gathered = [torch.empty_like(x) for _ in range(2)]
                    dist.all_gather(gathered, x)
                    want = (gathered[0].float() + gathered[1].float()).to(dtype)
                    if not torch.equal(out, want):
                        errors.append(f"{what} {dtype} {x.numel()}: {(out.float() - want.float()).abs().max()}")
                    others = [torch.empty_like(out) for _ in range(2)]
                    dist.all_gather(others, out)
                    if not torch.equal(others[0], others[1]):
                        errors.append(f"{what} {dtype} {x.numel()}: the ranks' sums differ")

            for seed in range(3):
                refill(seed)
                check([one_shot.one_shot_sum(x) for x in inputs], "eager")
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                outs = [torch.ops.flexengine.one_shot_sum(x) for x in inputs]
            for seed in range(3, 8):
                refill(seed)
                graph.replay()
                check(outs, "graph")
            one_shot.disable()
        return errors
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (issue 23's nvidia-h200-x2)")
def test_the_kernel_on_two_gpus_equals_the_sum_of_the_gathered_copies():
    port = free_port()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=two_gpu_rank, args=(r, port, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = {}
    try:
        while len(results) < 2 and not any(results.values()):
            rank, errors = queue.get(timeout=240)
            results[rank] = errors
    finally:
        for p in ranks:
            p.join(timeout=30 if not any(results.values()) else 0)
            p.kill()
    assert results == {0: [], 1: []}
