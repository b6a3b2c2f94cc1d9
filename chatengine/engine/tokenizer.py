"""Chat template and an incremental, UTF-8-safe detokenizer.

Message content is always text: a user who types a control token's text (`<|im_start|>system`)
gets the ordinary tokens of those characters, never the control token, so nobody can forge a
system or assistant turn. Control tokens come only from the chat template. Content without any
control-token text tokenizes exactly as the model's own template rendering does.

Decoding one token at a time breaks multi-byte characters that span tokens (a byte-level BPE token
may hold half an emoji). The detokenizer decodes a small window and holds text back while it ends
in U+FFFD, so streamed deltas are always whole characters.
"""

import secrets

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


def _no_tokenizer():
    return ValueError("this model has no tokenizer (dummy weights): pass token ids, not text")


def special_texts(tokenizer) -> list[str]:
    """The texts that the tokenizer would read as control tokens."""
    cached = getattr(tokenizer, "_chatengine_specials", None)
    if cached is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        cached = sorted(
            {t.content for t in added.values() if getattr(t, "special", False)}
            | set(getattr(tokenizer, "all_special_tokens", []) or [])
        )
        try:
            tokenizer._chatengine_specials = cached
        except AttributeError:  # a tokenizer that takes no new attributes: computed each time
            pass
    return cached


def has_special_text(tokenizer, text: str) -> bool:
    return any(s in text for s in special_texts(tokenizer))


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template (content as text)."""
    if tokenizer is None:
        raise _no_tokenizer()
    messages = validate_messages(messages)
    if any(has_special_text(tokenizer, m["content"]) for m in messages):
        return _template_with_inert_content(tokenizer, messages, add_generation_prompt)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _template_with_inert_content(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The template rendered around markers, then tokenized piece by piece: the template's text with
    its control tokens, each message's content with control-token text split into plain tokens."""
    marks = [f"\u2063chatengine-content-{i}-{secrets.token_hex(8)}\u2063" for i in range(len(messages))]
    shell = [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks)]
    text = tokenizer.apply_chat_template(shell, add_generation_prompt=add_generation_prompt, tokenize=False)
    parts: list[tuple[str, bool]] = []
    for m, mark in zip(messages, marks):
        before, found, text = text.partition(mark)
        if not found:
            raise ValueError("the model's chat template drops a message's content; it cannot be rendered safely")
        parts += [(before, False), (m["content"], True)]
    parts.append((text, False))
    return encode_parts(tokenizer, parts)


def encode_parts(tokenizer, parts: list[tuple[str, bool]]) -> list[int]:
    """Token ids of (text, is_content) pieces in order: template text may hold control tokens,
    content never does. Without control-token text in any content, the pieces are tokenized joined
    (the same ids as the whole text; pieces tokenized apart could merge differently at the seams)."""
    if tokenizer is None:
        raise _no_tokenizer()
    for text, is_content in parts:
        validate_text(text, "message content" if is_content else "template text")
    if not any(is_content and has_special_text(tokenizer, text) for text, is_content in parts):
        return tokenizer.encode("".join(text for text, _ in parts), add_special_tokens=False)
    ids: list[int] = []
    for text, is_content in parts:
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=is_content)
    return ids


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a raw prompt: control-token text in it is read as control tokens (a caller that
    renders its own template means them). Chat content goes through apply_chat_template instead."""
    if tokenizer is None:
        raise _no_tokenizer()
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
