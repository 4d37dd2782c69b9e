"""The Triton kernel behind parallel/one_shot.py (its own module: triton is imported only when a sum launches).

One program sums BLOCK elements of every rank's copy. The symmetric buffer of each rank holds, from its start:
flags [MAX_PROGRAMS, WORLD] int64 (flags[p, s]: how many sums program p of rank s has handed over), then two data
slots of SLOT elements. A program copies its part of x into its own rank's slot, raises its flag in every peer's
buffer, waits for every peer's flag, then reads the peers' slots. The flags only grow, so nothing resets them, and
the slot alternates with the program's count of sums: the slot a program writes was last read by its peers two sums
ago, and they have finished reading it, because they have since raised their flags of the sum between, which they
do only after the kernel before has finished (PDL's wait, or plain stream order).
"""
import triton
import triton.language as tl


@triton.jit
def one_shot_sum_kernel(x_ptr, out_ptr, buffers, count_ptr, numel, FLAGS_BYTES: tl.constexpr, SLOT: tl.constexpr,
                        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    if USE_PDL:  # the next kernel may launch now (it waits for this one's writes itself); x is the last one's
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    dtype = x_ptr.dtype.element_ty
    base_of = buffers.to(tl.pointer_type(tl.uint64))  # rank → the address of its symmetric buffer
    sums = tl.load(count_ptr + pid)  # this program's sums so far (int64): its flag value and its slot
    flag = sums + 1
    slot = (sums % 2) * SLOT
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask)
    mine = tl.load(base_of + RANK)
    tl.store((mine + FLAGS_BYTES).to(tl.pointer_type(dtype)) + slot + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's part is stored before the flag below releases it
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(base_of + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(theirs + pid * WORLD + RANK, flag, sem="release", scope="sys")
    my_flags = mine.to(tl.pointer_type(tl.int64)) + pid * WORLD
    never = tl.full((), -1, tl.int64)  # no flag holds it
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            # an acquiring read: a compare-and-swap that never swaps (no flag is -1), so it writes nothing
            # (Triton's interpreter, which tests run on the CPU, reads and writes back an atomic_add of 0)
            waiting = tl.atomic_cas(my_flags + peer, never, never, sem="acquire", scope="sys") < flag
            while waiting:  # (the condition computed before the loop: the interpreter runs this form too)
                waiting = tl.atomic_cas(my_flags + peer, never, never, sem="acquire", scope="sys") < flag
    tl.debug_barrier()  # the acquire above is ordered before every thread's reads of the peers' slots
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):  # in rank order, so that every rank rounds the same sum alike
        if rank == RANK:
            total += x.to(tl.float32)
        else:
            theirs = (tl.load(base_of + rank) + FLAGS_BYTES).to(tl.pointer_type(dtype))
            total += tl.load(theirs + slot + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + offs, total.to(dtype), mask=mask)
    tl.store(count_ptr + pid, flag)
