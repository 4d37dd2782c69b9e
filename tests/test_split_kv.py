"""Split-KV decode's merge: attention over a request's pages in slices, merged by log-sum-exp, equals attention over
all of them (an independent reference: one softmax over the whole row), on CPU (torch) and on CUDA (Triton)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexengine.attention.split_kv import merge_splits_into


def slice_attention(q_BND, k_BLND, v_BLND, bounds):
    """Per slice [lo, hi) of the keys: (softmax attention output, its natural log-sum-exp), float64;
    an empty slice gives zeros and lse -inf, as flex does."""
    outs, lses = [], []
    for lo, hi in bounds:
        s = torch.einsum("bnd,blnd->bnl", q_BND, k_BLND[:, lo:hi])
        if hi > lo:
            lses.append(torch.logsumexp(s, -1))
            outs.append(torch.einsum("bnl,blnd->bnd", s.softmax(-1), v_BLND[:, lo:hi]))
        else:
            lses.append(torch.full(s.shape[:2], float("-inf"), dtype=s.dtype))
            outs.append(torch.zeros_like(q_BND))
    return torch.stack(outs, 1), torch.stack(lses, 1)  # [B, S, N, D], [B, S, N]


def check_merge(device, B, S, N, D, L, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, L, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    cuts = sorted(torch.randint(0, L + 1, (S - 1,), generator=g).tolist())  # slices may be empty
    bounds = list(zip([0] + cuts, cuts + [L]))
    part, lse = slice_attention(q, k, v, bounds)
    whole = torch.einsum("bnl,blnd->bnd", torch.einsum("bnd,blnd->bnl", q, k).softmax(-1), v)
    T = B + 3
    dst = torch.randperm(T, generator=g)[:B]
    out = torch.full((T, N, D), float("nan"), dtype=dtype, device=device)
    merge_splits_into(out, dst.to(device), part.reshape(B * S, N, D).to(device, dtype),
                      lse.reshape(B * S, N).to(device, torch.float32), S)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[dst.to(device)].double().cpu(), whole, atol=tol, rtol=tol)
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[dst] = False
    assert out[untouched.to(device)].isnan().all()  # only the requests' rows are written


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), S=st.integers(1, 9), N=st.integers(1, 5), D=st.sampled_from([8, 24]), L=st.integers(1, 40),
       seed=st.integers(0, 2 ** 16))
def test_merge_equals_attention_over_all_keys(B, S, N, D, L, seed):
    check_merge("cpu", B, S, N, D, L, seed)


def test_all_splits_empty_gives_zeros():
    out = torch.full((2, 1, 4), float("nan"))
    part, lse = torch.zeros(3, 1, 4), torch.full((3, 1), float("-inf"))
    merge_splits_into(out, torch.tensor([1]), part, lse, 3)
    assert out[1].eq(0).all() and out[0].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("S,D,dtype", [(32, 128, torch.bfloat16), (5, 80, torch.float32), (16, 64, torch.bfloat16),
                                       (3, 72, torch.float16)])
def test_triton_merge_equals_attention_over_all_keys(S, D, dtype):
    for seed in range(4):
        check_merge("cuda", 3, S, 8, D, 300, seed, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("splits", [1, 3])
def test_rows_of_padding_requests_are_dropped(device, splits):
    """dst -1 (a padded decode row of a CUDA graph) writes nothing; with one split and no lse the merge is a
    plain scatter of each row to its token."""
    g = torch.Generator().manual_seed(splits)
    B, N, D = 4, 2, 8
    part = torch.randn(B * splits, N, D, generator=g).to(device)
    lse = torch.randn(B * splits, N, generator=g).to(device) if splits > 1 else None
    dst = torch.tensor([5, -1, 0, -1], device=device)
    out = torch.full((7, N, D), 7.0, device=device)
    merge_splits_into(out, dst, part, lse, splits)
    if splits == 1:
        want = {5: part[0], 0: part[2]}
    else:  # the weights: softmax of each request's lse over its splits
        w = lse.view(B, splits, N).softmax(1)[..., None]
        merged = (w * part.view(B, splits, N, D)).sum(1)
        want = {5: merged[0], 0: merged[2]}
    for t in range(7):
        torch.testing.assert_close(out[t], want.get(t, torch.full((N, D), 7.0, device=device)))


def test_decode_kernel_options_keep_the_kv_tile_inside_a_page(monkeypatch):
    """flex's decode kernel gets the split count, and a KV tile no wider than a page, whatever tiles are asked for;
    three pipeline stages only where torch meant them (sm90/sm100, not float32 heads over 128), never off CUDA."""
    from flexengine.attention.backends import flex_kernels as flex
    q = torch.empty(2, 4, 64)
    assert flex.decode_kernel_options(128, 1, q) == {"SPLIT_KV": 1}  # flex's own 64-wide tile
    assert flex.decode_kernel_options(16, 4, q) == {"SPLIT_KV": 4, "BLOCK_N": 16}
    monkeypatch.setattr(flex, "DECODE_OPTIONS", {"BLOCK_N": 128, "num_stages": 2})
    assert flex.decode_kernel_options(64, 2, q) == {"SPLIT_KV": 2, "BLOCK_N": 64, "num_stages": 2}
    assert flex.decode_kernel_options(256, 2, q) == {"SPLIT_KV": 2, "BLOCK_N": 128, "num_stages": 2}
    monkeypatch.setattr(flex, "DECODE_OPTIONS", None)
    cuda = torch.device("cuda", 0)
    for capability, head_dim, dtype, stages in (((9, 0), 128, torch.bfloat16, 3), ((9, 0), 256, torch.bfloat16, 3),
                                                ((9, 0), 128, torch.float32, 3), ((9, 0), 256, torch.float32, None),
                                                ((10, 0), 64, torch.float16, 3), ((8, 0), 128, torch.bfloat16, None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        flex.default_decode_options.cache_clear()
        got = flex.default_decode_options(cuda, head_dim, dtype)
        assert got == ({"num_stages": stages} if stages else {}), (capability, head_dim, dtype)
    flex.default_decode_options.cache_clear()
