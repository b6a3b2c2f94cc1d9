"""Chat template and an incremental, UTF-8-safe detokenizer.

Decoding one token at a time breaks multi-byte characters that span tokens (a byte-level BPE token
may hold half an emoji). The detokenizer decodes a small window and holds text back while it ends
in U+FFFD, so streamed deltas are always whole characters.
"""

ROLES = ("system", "user", "assistant")


def validate_text(text, what: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate at position {e.start})") from None
    return text


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": validate_text(m["content"], f"messages[{i}].content")})
    return out


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (dummy weights): pass token ids, not text")
    ids = tokenizer.apply_chat_template(
        validate_messages(messages), add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (dummy weights): pass token ids, not text")
    return tokenizer.encode(validate_text(text, "prompt"), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded again for context
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new complete text (possibly "")."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:  # dummy weights have no text: skip slicing the growing id list
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing yet, or an unfinished multi-byte character
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is held back (a truly invalid byte sequence decodes as U+FFFD)."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
