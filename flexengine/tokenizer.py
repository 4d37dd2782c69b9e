"""Tokenizer loading, streaming detokenization, and the byte-level tokenizer of the built-in models."""
from __future__ import annotations

import codecs
import functools
import logging
import os
import random

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258, after the 256 byte symbols
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIALS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """AutoTokenizer for a checkpoint directory that has tokenizer files, else None."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def backend_decoder(tokenizer, skip_special_tokens: bool):
    """ids → text, exactly as `tokenizer.decode(ids, skip_special_tokens=...)`.

    For a fast tokenizer whose Python side changes nothing (the base class's decode, no space
    clean-up) this calls the Rust backend directly: transformers' decode wraps it in several
    microseconds of argument conversion, and a streamed token takes two decodes. (Not the backend's
    decode_batch: for a step's few-token windows its thread pool costs more than it saves, and on the
    H100 box it kept four cores busy.)
    """
    if uses_backend(tokenizer):
        backend = tokenizer._tokenizer.decode
        return lambda ids: backend(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def uses_backend(tokenizer) -> bool:
    """A fast tokenizer whose Python side changes nothing of the decoded text (the base class's decode,
    no space clean-up): the Rust backend's decode gives exactly what `tokenizer.decode` gives."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces)


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    """Each token id's bytes, when decoding is joining them and reading the result as UTF-8 (invalid
    bytes become U+FFFD): a backend tokenizer whose decoder is ByteLevel alone (GPT-2, Llama 3, Qwen).
    Streaming then needs no decode call per token. None for any other tokenizer.

    The ByteLevel decoder maps each character of a token through GPT-2's byte table (a token with a
    character outside it contributes its own UTF-8), joins the bytes of all tokens and decodes them
    lossily; skipped special tokens contribute nothing, and so do ids the tokenizer does not have.
    Checked against the backend's decode on random ids before use.
    """
    from tokenizers import decoders
    if not uses_backend(tokenizer) or not isinstance(tokenizer._tokenizer.decoder, decoders.ByteLevel):
        return None
    backend = tokenizer._tokenizer
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special} if skip_special_tokens else set()
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None or i in special:
            table.append(b"")
        elif all(c in byte_of for c in token):
            table.append(bytes(byte_of[c] for c in token))
        else:
            table.append(token.encode())
    rng = random.Random(0)
    for _ in range(64):
        ids = [rng.randrange(len(table) + 8) for _ in range(rng.randint(1, 12))]
        joined = b"".join(table[i] if i < len(table) else b"" for i in ids).decode("utf-8", "replace")
        if joined != backend.decode(ids, skip_special_tokens=skip_special_tokens):
            logger.info("streaming detokenization decodes windows: this ByteLevel tokenizer's text is not "
                        "its tokens' bytes joined")
            return None
    return tuple(table)


class IncrementalDetokenizer:
    """Feed generated token ids one at a time; `add` returns the new text they complete.

    Decodes a short window (a few tokens of context before the unread ones, so tokenizers that
    glue words with spaces decode the same as in full text). Text that ends in U+FFFD is a UTF-8
    sequence split across tokens: it is held back until the next token completes it. The window
    never starts inside a character, where it would decode to a spurious U+FFFD. `add_tokens` does
    `add` for many detokenizers in one pass.

    For a tokenizer with `token_bytes`, no window is decoded: each token's bytes go through an
    incremental UTF-8 decoder, which holds back a character split across tokens by itself.
    """

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._decode = backend_decoder(tokenizer, skip_special_tokens)  # ids -> text
        self.ids = list(prompt_ids)  # ints (the engine's tokenize checks): a copy in C, not a conversion per id
        self.read_offset = len(self.ids)
        self.text = ""
        self.pieces = token_bytes(tokenizer, skip_special_tokens)
        if self.pieces is not None:
            self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self.utf8.decode(self._tail_bytes())  # a prompt's broken tail belongs to the text to come
            return
        self.prefix_offset = self._clean_start(max(len(self.ids) - 5, 0), self.read_offset)

    def _tail_bytes(self) -> bytes:
        """The bytes of the prompt's last tokens, at least 4 of them where the prompt has so many: all the
        incremental decoder must see to hold back a character the prompt leaves unfinished (at most 3 bytes),
        instead of the whole prompt's (scripts/add_request_time.py: admitting 65,536 tokens 9.6 -> 4.1 ms with
        the id checks)."""
        tail, n, pieces, known = [], 0, self.pieces, len(self.pieces)
        for i in reversed(self.ids):  # (ids without bytes, as a random prompt's past a small tokenizer, are skipped
            piece = pieces[i] if i < known else b""  # at a lookup each: all 256 of one took 88 µs before)
            if piece:
                tail.append(piece)
                n += len(piece)
                if n >= 4:
                    break
        return b"".join(reversed(tail))

    def _bytes(self, ids) -> bytes:
        pieces = self.pieces
        return b"".join(pieces[i] if i < len(pieces) else b"" for i in ids)

    def _clean_start(self, start: int, end: int) -> int:
        """`start`, moved back until ids[start:end] does not begin inside a character. Keeps the text
        of ids[start:end] (ids only grow, so a range keeps its text), the next window's prefix, so `add`
        decodes it once, not twice."""
        text = self._decode(self.ids[start:end])
        while start > 0 and text.startswith("\ufffd"):
            start -= 1
            text = self._decode(self.ids[start:end])
        self._prefix = (start, end, text)
        return start

    def _prefix_text(self) -> str:
        """The text already read of the window. A prompt may end inside a character; its broken tail
        belongs to the text still to come."""
        start, stop, text = self._prefix
        if (start, stop) != (self.prefix_offset, self.read_offset):
            text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return text.rstrip("\ufffd")

    def _window(self, end: int) -> tuple[str, str]:
        """(text already read, text up to ids[end]) of the window: the new text is what the second adds."""
        return self._prefix_text(), self._decode(self.ids[self.prefix_offset:end])

    def add(self, token_id: int) -> str:
        return add_tokens([self], [token_id])[0]

    def emitted_by_add(self) -> str:
        """For ids appended without `add`: the text `add` would have returned for them one by one,
        that is, up to the last token after which the text did not end inside a character."""
        if self.pieces is not None:
            self.read_offset, start = len(self.ids), self.read_offset
            return self.utf8.decode(self._bytes(self.ids[start:]))
        end = len(self.ids)
        while end > self.read_offset and self._decode(self.ids[self.prefix_offset:end]).endswith("\ufffd"):
            end -= 1
        if end == self.read_offset:
            return ""
        prefix, full = self._window(end)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (possibly with U+FFFD)."""
        if self.pieces is not None:
            delta = self.emitted_by_add() + self.utf8.decode(b"", final=True)
            self.text += delta
            return delta
        prefix, full = self._window(len(self.ids))
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def add_tokens(detoks: list[IncrementalDetokenizer], token_ids: list[int]) -> list[str]:
    """`add(token)` for each detokenizer (one token each, in parallel lists): a step's sequences in
    one pass, two decodes each (the window, then the next window's prefix)."""
    deltas, windowed = [""] * len(detoks), []
    for i, (d, t) in enumerate(zip(detoks, token_ids)):
        t = int(t)
        d.ids.append(t)
        if d.pieces is None:
            windowed.append(i)
        else:
            d.read_offset = len(d.ids)
            deltas[i] = d.utf8.decode(d.pieces[t] if t < len(d.pieces) else b"")
            d.text += deltas[i]
    for i in windowed:
        d = detoks[i]
        full = d._decode(d.ids[d.prefix_offset:])
        prefix = d._prefix_text()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            continue  # held back
        deltas[i] = full[len(prefix):]
        end = len(d.ids)
        d.prefix_offset, d.read_offset = d._clean_start(d.read_offset, end), end
        d.text += deltas[i]
    return deltas


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable Latin-1 bytes map to themselves, the rest
    to code points from 256 up, so every byte is one visible symbol."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_tokenizer():
    """A PreTrainedTokenizerFast over raw UTF-8 bytes: ids 0-255 are bytes, then <bos> <eos> <pad>.
    No merges, so any text encodes and every id sequence decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in BYTE_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 256)])
    assert tok.get_vocab_size() == BYTE_VOCAB_SIZE
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def save_byte_tokenizer(out_dir: str) -> None:
    build_byte_tokenizer().save_pretrained(out_dir)
