"""Tokenizer loading, streaming detokenization, and the byte-level tokenizer of the built-in models."""
from __future__ import annotations

import os

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
    microseconds of argument conversion, and a streamed token takes two decodes.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        backend = tokenizer._tokenizer.decode
        return lambda ids: backend(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Feed generated token ids one at a time; `add` returns the new text they complete.

    Decodes a short window (a few tokens of context before the unread ones, so tokenizers that
    glue words with spaces decode the same as in full text). Text that ends in U+FFFD is a UTF-8
    sequence split across tokens: it is held back until the next token completes it. The window
    never starts inside a character, where it would decode to a spurious U+FFFD.
    """

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._decode = backend_decoder(tokenizer, skip_special_tokens)  # ids -> text
        self.ids = [int(t) for t in prompt_ids]
        self.read_offset = len(self.ids)
        self.prefix_offset = self._clean_start(max(len(self.ids) - 5, 0), self.read_offset)
        self.text = ""

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

    def _window(self, end: int) -> tuple[str, str]:
        """(text already read, text up to ids[end]) of the window: the new text is what the second
        adds. A prompt may end inside a character; its broken tail belongs to the text still to come."""
        start, stop, text = self._prefix
        if (start, stop) != (self.prefix_offset, self.read_offset):
            text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return text.rstrip("\ufffd"), self._decode(self.ids[self.prefix_offset:end])

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix, full = self._window(len(self.ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self._clean_start(self.read_offset, len(self.ids)), len(self.ids)
        self.text += delta
        return delta

    def emitted_by_add(self) -> str:
        """For ids appended without `add`: the text `add` would have returned for them one by one,
        that is, up to the last token after which the text did not end inside a character."""
        end = len(self.ids)
        while end > self.read_offset and self._decode(self.ids[self.prefix_offset:end]).endswith("\ufffd"):
            end -= 1
        if end == self.read_offset:
            return ""
        prefix, full = self._window(end)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (possibly with U+FFFD)."""
        prefix, full = self._window(len(self.ids))
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


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
