"""Conversations → prompt token ids through the tokenizer's chat template (LLM.chat and the server's
/v1/chat/completions)."""
from __future__ import annotations


def conversations(messages) -> list[list[dict]]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them → a list of them, checked."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) or a "
                         "list of conversations")
    convs = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"conversation {i} must be a non-empty list of messages, got {type(conv).__name__}")
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"conversation {i}, message {j}: a message is a dict with a string 'role', got {m!r}")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise ValueError(f"conversation {i}, message {j}: 'content' must be a string or a list of text "
                                 f"parts, got {type(content).__name__}")
    return [[_flat(m) for m in conv] for conv in convs]


def _flat(message: dict) -> dict:
    """OpenAI-style content parts ([{"type": "text", "text": ...}]) joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {**message, "content": content or ""}


def chat_prompt_ids(tokenizer, conversation: list[dict], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(prompt text, token ids) of one conversation; ValueError without a template or when it fails."""
    template = chat_template or (getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template: pass chat_template=..., or use generate "
                         "(/v1/completions at the server)")
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as e:  # e.g. a template that insists on alternating roles
        raise ValueError(f"chat template rejected the messages: {e}") from e
    # The template already wrote any BOS; do not let the tokenizer add another.
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def read_chat_template(path: str | None, command: str) -> str | None:
    """--chat-template FILE's text (None without one); a path that cannot be read ends `command` at once."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"flexengine {command}: cannot read --chat-template {path}: {e.strerror}") from e
