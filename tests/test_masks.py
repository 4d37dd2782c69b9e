"""flexengine.masks: semantics against plain Python, the registry, composition and errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import PLAIN_MASKS
from flexengine import masks

GRID = torch.arange(40)
Q, KV = GRID[:, None], GRID[None, :]


def grid(plain):
    return torch.tensor([[plain(0, 0, q, kv) for kv in range(40)] for q in range(40)])


@pytest.mark.parametrize("mod,plain", [
    (masks.causal, PLAIN_MASKS["causal"]),
    (masks.bidirectional, PLAIN_MASKS["bidirectional"]),
    (masks.sliding_window(1), PLAIN_MASKS["sliding_window"](1)),
    (masks.sliding_window(7), PLAIN_MASKS["sliding_window"](7)),
    (masks.chunked_local(6), PLAIN_MASKS["chunked_local"](6)),
    (masks.prefix_lm(9), PLAIN_MASKS["prefix_lm"](9)),
    (masks.prefix_lm(0), PLAIN_MASKS["causal"]),
])
def test_builtin_masks_match_their_definition(mod, plain):
    assert torch.equal(mod(0, 0, Q, KV), grid(plain))


def test_sliding_window_counts_the_token_itself():
    row = masks.sliding_window(3)(0, 0, torch.tensor(10), GRID)
    assert GRID[row].tolist() == [8, 9, 10]


def test_score_mods():
    s = torch.tensor([[-50.0, 0.3, 80.0]])
    torch.testing.assert_close(masks.softcap(30.0)(s, 0, 0, 0, 0), 30.0 * torch.tanh(s / 30.0))
    al = masks.alibi([0.5, 0.25])
    out = al(torch.zeros(2, 1, 3), 0, torch.arange(2)[:, None, None], torch.tensor(5), torch.tensor([3, 4, 5]))
    torch.testing.assert_close(out[:, 0], torch.tensor([[-1.0, -0.5, 0.0], [-0.5, -0.25, 0.0]]))


def test_composition():
    both = masks.and_masks("causal", masks.sliding_window(4))
    either = masks.or_masks(masks.chunked_local(8), masks.prefix_lm(3))
    assert torch.equal(both(0, 0, Q, KV), grid(PLAIN_MASKS["sliding_window"](4)))
    assert torch.equal(either(0, 0, Q, KV), grid(lambda b, h, q, kv: (kv <= q and q // 8 == kv // 8) or kv <= q or kv < 3))


def test_registry_names_and_errors():
    assert {"causal", "bidirectional", "prefix_lm"} <= set(masks.list_mask_mods())
    with pytest.raises(ValueError, match="causal"):  # the message lists what is registered
        masks.get_mask_mod("no_such_mask")
    with pytest.raises(ValueError, match="no_such_score"):
        masks.get_score_mod("no_such_score")

    @masks.register_mask_mod("test_twice", replace=True)
    def first(b, h, q, kv):
        return kv <= q

    with pytest.raises(ValueError, match="already registered"):
        masks.register_mask_mod("test_twice")(lambda b, h, q, kv: kv >= 0)
    masks.register_mask_mod("test_twice", replace=True)(lambda b, h, q, kv: kv >= 0)
    assert masks.get_mask_mod("test_twice") is not first

    @masks.register_score_mod("test_double", replace=True)
    def double(score, b, h, q, kv):
        return 2 * score

    assert masks.get_score_mod("test_double") is double and "test_double" in masks.list_score_mods()


@pytest.mark.parametrize("bad", [0, -3, 2.5 - 2.5, True, "8"])
def test_parameters_must_be_positive(bad):
    for factory in (masks.sliding_window, masks.chunked_local, masks.softcap):
        with pytest.raises(ValueError):
            factory(bad)


def test_alibi_head_count_checked_at_call_time():
    from flexengine.attention import paged_attention
    al = masks.alibi([0.5, 0.25, 0.125])  # building it is fine
    q, kc = torch.randn(4, 4, 8), torch.randn(2, 4, 2, 8)
    with pytest.raises(ValueError, match="3 slopes but the query has 4 heads"):
        paged_attention(q, kc, kc.clone(), torch.tensor([[0]], dtype=torch.int32), torch.tensor([4]),
                        torch.tensor([4]), score_mod=al)


BOUNDED = [masks.causal, masks.bidirectional, masks.sliding_window(5), masks.chunked_local(7), masks.prefix_lm(11),
           masks.and_masks(masks.sliding_window(9), masks.chunked_local(4)),
           masks.or_masks(masks.sliding_window(3), masks.prefix_lm(6))]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BOUNDED), st.integers(0, 60), st.integers(0, 20), st.integers(0, 20))
def test_kv_bounds_are_sound(mod, q_lo, span, extra):
    """Every allowed kv lies in [any_lo, any_hi); every kv in [all_lo, all_hi) is allowed for the whole tile."""
    q_hi, L = q_lo + span, q_lo + span + 1 + extra
    t = lambda x: torch.tensor([x])  # noqa: E731
    a_lo, a_hi, f_lo, f_hi = (int(x) for x in mod.kv_bounds(t(0), t(q_lo), t(q_hi), t(L)))
    for q in range(q_lo, q_hi + 1):
        for kv in range(L):
            ok = bool(mod(0, 0, torch.tensor(q), torch.tensor(kv)))
            if ok:
                assert a_lo <= kv < a_hi
            if f_lo <= kv < f_hi:
                assert ok


def test_mod_checks_name_the_mod_and_the_problem():
    def returns_float(b, h, q, kv):
        return (kv <= q).float()

    def wrong_shape(b, h, q, kv):
        return torch.stack([kv <= q, kv <= q])

    def raises(b, h, q, kv):
        raise RuntimeError("boom")

    def control_flow(b, h, q, kv):
        if q > kv:
            return kv >= 0
        return kv < 0

    for fn, message in [(returns_float, "returns_float must return a bool tensor, got torch.float32"),
                        (wrong_shape, r"wrong_shape must return one bool .* shape \(2,\)"),
                        (raises, "raises raised RuntimeError .*boom"),
                        (control_flow, "control_flow uses Python control flow on tensors")]:
        with pytest.raises(ValueError, match=message):
            masks.check_mask_mod(fn)
    masks.check_mask_mod(masks.sliding_window(3))
    masks.check_score_mod(masks.softcap(2.0))
    with pytest.raises(ValueError, match="score_mod bad_score must return a float score"):
        def bad_score(score, b, h, q, kv):
            return score > 0
        masks.check_score_mod(bad_score)


def test_bad_mod_is_reported_by_paged_attention():
    from flexengine.attention import paged_attention
    q, kc = torch.randn(4, 2, 8), torch.randn(2, 4, 2, 8)

    def flaky(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx).int()

    with pytest.raises(ValueError, match="flaky must return a bool tensor"):
        paged_attention(q, kc, kc.clone(), torch.tensor([[0]], dtype=torch.int32), torch.tensor([4]),
                        torch.tensor([4]), mask_mod=flaky)
