"""The prefill workspace's copy: pages of the paged cache → consecutive pages of the workspace.

`src_pages[i]` is the physical page the workspace's page i copies, or -1 for a page no tile reads
(a request's alignment tail, or padding up to a CUDA graph's fixed size), which is skipped. On CUDA
one Triton launch copies K and V and skips those pages, so a graph can be sized for the most pages
its steps may gather and still cost only what a step gathers; elsewhere index_select copies all.
"""
from __future__ import annotations

import functools

import torch


def gather_pages(key_cache: torch.Tensor, value_cache: torch.Tensor, src_pages: torch.Tensor,
                 k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """k_out[i] = key_cache[src_pages[i]] (and v) for every i with src_pages[i] >= 0."""
    W = len(src_pages)
    assert k_out.shape[0] >= W and k_out.shape[1:] == key_cache.shape[1:], (k_out.shape, key_cache.shape, W)
    if W == 0:
        return
    if key_cache.is_cuda:
        page_elems = key_cache[0].numel()
        kernel = _triton_kernel()
        kernel[(W,)](key_cache, value_cache, k_out, v_out, src_pages, PAGE=page_elems,
                     BLOCK=min(4096, 1 << (page_elems - 1).bit_length()))
        return
    src = src_pages.clamp(min=0)  # skipped pages are copied from page 0 here: never read either way
    torch.index_select(key_cache, 0, src, out=k_out[:W])
    torch.index_select(value_cache, 0, src, out=v_out[:W])


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_pages(k_src, v_src, k_dst, v_dst, src_pages, PAGE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        page = tl.load(src_pages + i).to(tl.int64)
        if page >= 0:
            src, dst = page * PAGE, i.to(tl.int64) * PAGE
            for start in range(0, PAGE, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                keep = offs < PAGE
                tl.store(k_dst + dst + offs, tl.load(k_src + src + offs, mask=keep), mask=keep)
                tl.store(v_dst + dst + offs, tl.load(v_src + src + offs, mask=keep), mask=keep)

    return copy_pages
