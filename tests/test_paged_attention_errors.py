"""Every inconsistent input to paged_attention is a ValueError that says what is wrong."""
import pytest
import torch

from flexengine.attention import paged_attention


def args(**over):
    a = dict(query=torch.randn(5, 4, 16), key_cache=torch.randn(6, 4, 2, 16), value_cache=torch.randn(6, 4, 2, 16),
             block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), seq_lens=torch.tensor([8, 1]),
             query_lens=torch.tensor([4, 1]))
    a.update(over)
    return a


def call(**over):
    a = args(**over)
    return paged_attention(a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"],
                           a["query_lens"])


def test_valid_call_runs():
    assert call().shape == (5, 4, 16)


@pytest.mark.parametrize("over,message", [
    (dict(query_lens=torch.tensor([3, 1])), "sum to 4 but query has 5"),
    (dict(seq_lens=torch.tensor([3, 1]), query_lens=torch.tensor([4, 1])), "query_len 4 is longer than its context"),
    (dict(query=torch.randn(5, 3, 16)), "Hq=3 is not a multiple of Hkv=2"),
    (dict(query=torch.randn(5, 4, 16, dtype=torch.float64)), "dtype mismatch"),
    (dict(seq_lens=torch.tensor([9, 1])), "block table is too short"),
    (dict(block_tables=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), r"entries must be in \[0, 6\)"),
    (dict(query=torch.randn(5, 4, 8)), "head size mismatch"),
    (dict(value_cache=torch.randn(6, 4, 1, 16)), "value_cache shape"),
    (dict(seq_lens=torch.tensor([8, 1, 1])), "block_tables has 2 rows"),
    (dict(query_lens=torch.tensor([5, 0])), "query_lens must be >= 1"),
    (dict(seq_lens=torch.tensor([8.0, 1.0])), "seq_lens must be an integer tensor"),
    (dict(query=torch.randn(5, 4)), r"query must be \[num_tokens, Hq, D\]"),
])
def test_invalid_inputs(over, message):
    with pytest.raises(ValueError, match=message):
        call(**over)


def test_device_mismatch_is_named():
    a = args(key_cache=torch.randn(6, 4, 2, 16, device="meta"), value_cache=torch.randn(6, 4, 2, 16, device="meta"))
    with pytest.raises(ValueError, match="device mismatch"):
        paged_attention(*a.values())


def test_backend_names(monkeypatch):
    with pytest.raises(ValueError, match="flex, flash, reference, auto"):
        paged_attention(*args().values(), backend="fastest")
    monkeypatch.setenv("FLEXENGINE_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match="FLEXENGINE_ATTENTION_BACKEND"):
        paged_attention(*args().values())
    monkeypatch.setenv("FLEXENGINE_ATTENTION_BACKEND", "reference")
    a = args()
    ref = paged_attention(*a.values())
    torch.testing.assert_close(ref, paged_attention(*a.values(), backend="flex"), atol=1e-5, rtol=1e-5)


def test_any_gqa_ratio_and_odd_head_sizes():
    for Hq, Hkv, D in [(3, 1, 72), (6, 2, 80), (12, 4, 16)]:
        a = args(query=torch.randn(5, Hq, D), key_cache=torch.randn(6, 4, Hkv, D), value_cache=torch.randn(6, 4, Hkv, D))
        out = paged_attention(*a.values(), backend="flex")
        torch.testing.assert_close(out, paged_attention(*a.values(), backend="reference"), atol=1e-5, rtol=1e-5)
