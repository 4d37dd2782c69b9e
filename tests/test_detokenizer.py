"""The streaming detokenizer's fast path: decoding through the tokenizers backend gives exactly what
`tokenizer.decode` gives, and streamed text (with the window prefix kept between tokens) is the text
of the whole sequence."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine.tokenizer import BYTE_VOCAB_SIZE, IncrementalDetokenizer, backend_decoder, build_byte_tokenizer

ids = st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=12)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


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


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(32, 126), max_size=8), output=st.lists(st.integers(0, 258), min_size=1, max_size=16))
def test_streamed_text_is_the_text_of_the_whole_sequence(tok, prompt, output):
    """Every delta joined, plus what flush releases, is the output's text: the prefix text kept from one
    token to the next must always be the prefix of the current window. (Prompts of whole characters:
    a prompt's broken tail belongs to the first output character.)"""
    detok = IncrementalDetokenizer(tok, [256] + prompt)
    streamed = "".join(detok.add(t) for t in output) + detok.flush()
    assert streamed == tok.decode(output, skip_special_tokens=True)
