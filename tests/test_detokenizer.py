"""The streaming detokenizer's fast paths: decoding through the tokenizers backend gives exactly what
`tokenizer.decode` gives, a ByteLevel tokenizer's text is its tokens' bytes joined, and streamed text
(with the window prefix kept between tokens, or token bytes through an incremental UTF-8 decoder) is
the text of the whole sequence."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexengine import tokenizer as tokenizer_module
from flexengine.tokenizer import (BYTE_VOCAB_SIZE, IncrementalDetokenizer, add_tokens, backend_decoder,
                                  build_byte_tokenizer, bytes_to_unicode, token_bytes)

ids = st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=12)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(params=["token bytes", "windows"])
def mode(request, monkeypatch, tok):
    """Stream with the byte table (the byte tokenizer has one) or, without it, by decoding windows."""
    if request.param == "windows":
        monkeypatch.setattr(tokenizer_module, "token_bytes", lambda *args: None)
    assert (IncrementalDetokenizer(tok).pieces is None) == (request.param == "windows")
    return request.param


def bpe_tokenizer():
    """A ByteLevel BPE with merges, a plain added token and a special one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = bytes_to_unicode()
    vocab = {ch: b for b, ch in chars.items()}
    merges = [(chars[32], "t"), ("h", "e"), (chars[32] + "t", "he"), (chars[0xC3], chars[0xA9])]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken("<x>", special=False, normalized=False)])
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@settings(max_examples=300, deadline=None)
@given(token_ids=st.lists(st.integers(0, 270), max_size=12), skip=st.booleans())
def test_token_bytes_joined_are_the_decoded_text(token_ids, skip):
    bpe = bpe_tokenizer()
    table = token_bytes(bpe, skip)
    assert table is not None and len(table) == 256 + 4 + 2
    joined = b"".join(table[i] if i < len(table) else b"" for i in token_ids).decode("utf-8", "replace")
    assert joined == bpe.decode(token_ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(token_ids=ids, skip=st.booleans())
def test_backend_decoder_equals_decode(tok, token_ids, skip):
    # Byte ids may split UTF-8 characters (U+FFFD), and ids 256-258 are special tokens.
    assert backend_decoder(tok, skip)(token_ids) == tok.decode(token_ids, skip_special_tokens=skip)


def test_backend_decoder_falls_back_where_python_changes_the_text(tok):
    class Shouting(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    loud = Shouting(tokenizer_object=tok.backend_tokenizer)
    assert backend_decoder(loud, True)([104, 105]) == "HI" == loud.decode([104, 105])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(32, 126), max_size=8), output=st.lists(st.integers(0, 258), min_size=1, max_size=16))
def test_streamed_text_is_the_text_of_the_whole_sequence(tok, mode, prompt, output):
    """Every delta joined, plus what flush releases, is the output's text: the prefix text kept from one
    token to the next must always be the prefix of the current window. (Prompts of whole characters:
    a prompt's broken tail belongs to the first output character.)"""
    detok = IncrementalDetokenizer(tok, [256] + prompt)
    streamed = "".join(detok.add(t) for t in output) + detok.flush()
    assert streamed == tok.decode(output, skip_special_tokens=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams=st.lists(st.tuples(st.lists(st.integers(32, 126), max_size=8),
                                  st.lists(st.integers(0, 258), min_size=1, max_size=12)), min_size=1, max_size=5))
def test_batched_add_streams_each_sequence_whole(tok, mode, streams):
    """add_tokens over several sequences at once, each step taking those not yet done (as an engine step
    does): each sequence's deltas, plus its flush, are the text of its whole output."""
    detoks = [IncrementalDetokenizer(tok, [256] + prompt) for prompt, _ in streams]
    texts = [""] * len(streams)
    for step in range(max(len(out) for _, out in streams)):
        live = [i for i, (_, out) in enumerate(streams) if step < len(out)]
        for i, delta in zip(live, add_tokens([detoks[i] for i in live], [streams[i][1][step] for i in live])):
            texts[i] += delta
    for (_, out), detok, text in zip(streams, detoks, texts):
        assert text + detok.flush() == tok.decode(out, skip_special_tokens=True)


@st.composite
def split_character(draw):
    """(prompt, output) byte ids: any bytes, then a character's UTF-8 cut between the prompt's end and the output."""
    head, tail = draw(ids), draw(st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=6))
    char = list(draw(st.characters(min_codepoint=0x80, exclude_categories=("Cs",))).encode())
    cut = draw(st.integers(0, len(char)))
    return head + char[:cut], char[cut:] + tail or [32]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt_output=st.one_of(split_character(), st.tuples(ids, ids.filter(bool))))
def test_a_prompts_broken_tail_opens_the_first_output_character(tok, prompt_output):
    """With the byte table, the detokenizer reads only the prompt's last bytes: its text is what one UTF-8
    decoder fed every prompt byte, then each output token's, gives after the prompt (prompts of any bytes,
    special ids and characters split across them included)."""
    import codecs
    prompt, output = prompt_output
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.pieces is not None
    streamed = "".join(detok.add(t) for t in output) + detok.flush()
    table = token_bytes(tok, True)
    piece = lambda t: table[t] if t < len(table) else b""  # noqa: E731
    whole = codecs.getincrementaldecoder("utf-8")("replace")
    whole.decode(b"".join(map(piece, prompt)))
    assert streamed == "".join(whole.decode(piece(t)) for t in output) + whole.decode(b"", final=True)
