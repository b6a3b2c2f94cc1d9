"""Chat template and an incremental, UTF-8-safe detokenizer.

Message content is always text: a user who types a control token's text (`<|im_start|>system`)
gets the ordinary tokens of those characters, never the control token, so nobody can forge a
system or assistant turn. Control tokens come only from the chat template. Content without any
control-token text tokenizes exactly as the model's own template rendering does.

Decoding one token at a time breaks multi-byte characters that span tokens (a byte-level BPE token
may hold half an emoji). The detokenizer decodes a small window and holds text back while it ends
in U+FFFD, so streamed deltas are always whole characters.
"""

import logging
import re
import secrets

from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

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


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template (content as text).
    With `tools` (OpenAI-style function definitions), or messages with `tool_calls` or the role
    "tool", the template renders those too (see `template_supports_tools`)."""
    if tokenizer is None:
        raise _no_tokenizer()
    if tools is not None or any(_has_tool_fields(m) for m in messages if isinstance(m, dict)):
        return _template_with_tools(tokenizer, validate_tool_messages(messages), tools, add_generation_prompt)
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


# ---- tools ----------------------------------------------------------------------------------------
TOOL_ROLES = (*ROLES, "tool")


def template_supports_tools(tokenizer) -> bool:
    """Whether the model's chat template renders tool definitions (its source reads `tools`)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # several named templates: the one for tools, or the default
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _has_tool_fields(m: dict) -> bool:
    return m.get("role") == "tool" or bool(m.get("tool_calls"))


def validate_tool_messages(messages) -> list[dict]:
    """Messages that may hold tool calls (assistant `tool_calls`, content may be None) and tool
    results (role "tool", `tool_call_id`); every string in them must be valid Unicode."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in TOOL_ROLES:
            raise ValueError(f"messages[{i}] has unknown role {m['role']!r}; use one of {', '.join(TOOL_ROLES)}")
        if m.get("content") is None and not m.get("tool_calls"):
            raise ValueError(f"messages[{i}] must have 'content' (or, from the assistant, 'tool_calls')")
        _check_strings(m, f"messages[{i}]")
        out.append(dict(m))
    return out


def _check_strings(value, where: str) -> None:
    if isinstance(value, str):
        validate_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            _check_strings(v, f"{where}[{j}]")


def _template_with_tools(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
    """The template rendered with tools and tool messages. Every string the caller gave (contents,
    tool calls, tool results, tool definitions) is text: control-token text in it, and any piece at
    its ends that could join the template's text into a control token, is swapped for a marker
    before rendering and tokenized as plain characters where the marker lands."""
    kwargs = {"tools": tools} if tools is not None else {}
    specials = special_texts(tokenizer)
    if not any(_strings_hold_special(x, specials) for x in (messages, tools)):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    pieces: dict[str, str] = {}
    salt = secrets.token_hex(6)
    messages = _with_markers(messages, specials, pieces, salt)
    if tools is not None:
        kwargs["tools"] = _with_markers(tools, specials, pieces, salt)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    parts: list[tuple[str, bool]] = []
    pattern = re.compile(f"CEMARK{salt}x[0-9]+Z")
    at = 0
    for found in pattern.finditer(text):
        parts += [(text[at : found.start()], False), (pieces[found.group()], True)]
        at = found.end()
    parts.append((text[at:], False))
    return encode_parts(tokenizer, parts)


def _strings_hold_special(value, specials: list[str]) -> bool:
    if isinstance(value, str):
        return any(s in value for s in specials) or _edge_pieces(value, specials) != ("", value, "")
    if isinstance(value, dict):
        return any(_strings_hold_special(x, specials) for kv in value.items() for x in kv)
    if isinstance(value, (list, tuple)):
        return any(_strings_hold_special(v, specials) for v in value)
    return False


def _edge_pieces(text: str, specials: list[str]) -> tuple[str, str, str]:
    """(head, middle, tail): the longest start of `text` that ends some control token's text, and
    the longest end that begins one (either could join the template's text into a control token)."""
    head = max((text[:k] for s in specials for k in range(1, len(s)) if s.endswith(text[:k])), key=len, default="")
    rest = text[len(head) :]
    tail = max(
        (rest[-k:] for s in specials for k in range(1, len(s)) if k <= len(rest) and s.startswith(rest[-k:])),
        key=len,
        default="",
    )
    return head, rest[: len(rest) - len(tail)], tail


def _with_markers(value, specials: list[str], pieces: dict[str, str], salt: str):
    """A copy of `value` whose strings have each control-token text (and edge piece) replaced by a
    marker of letters and digits, which no template filter (tojson, trim) changes."""
    if isinstance(value, dict):
        return {
            _with_markers(k, specials, pieces, salt): _with_markers(v, specials, pieces, salt) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_with_markers(v, specials, pieces, salt) for v in value]
    if not isinstance(value, str):
        return value

    def mark(piece: str) -> str:
        if not piece:
            return ""
        key = f"CEMARK{salt}x{len(pieces)}Z"
        pieces[key] = piece
        return key

    head, middle, tail = _edge_pieces(value, specials)
    split = re.split("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")", middle)
    body = "".join(mark(p) if k % 2 else p for k, p in enumerate(split)) if specials else middle
    return mark(head) + body + mark(tail)


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
        # two decodes per token per sequence run on the engine's thread every step: the Rust
        # tokenizer's own decode skips ~7 us of Python around it, and transformers adds nothing
        # to its text unless clean_up_tokenization_spaces is on
        rust = getattr(tokenizer, "_tokenizer", None)
        plain = getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
        self._rust_decode = rust.decode if rust is not None and plain and hasattr(rust, "decode") else None
        # the same window algorithm in one Rust call a token (~6x faster than the two decodes):
        # its offsets are mirrored here, so flush() and a fallback to the decodes carry on from them
        self._rust = rust
        self._stream = DecodeStream(skip_special_tokens=True) if self._rust_decode is not None else None

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new complete text (possibly "")."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:  # dummy weights have no text: skip slicing the growing id list
            return ""
        if self._stream is None:
            return self._add_decoded()
        try:
            delta = self._stream.step(self._rust, token_id)
        except TypeError:  # a bad call, not a refusal: a bug to see
            raise
        except Exception as e:  # it refuses a text that does not extend its window's: the decodes from here
            log.debug("detokenizer: DecodeStream refused token %d (%s); decoding windows instead", token_id, e)
            self._stream = None
            return self._add_decoded()
        if not delta:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _add_decoded(self) -> str:
        """add() by two decodes: the window's text with and without the tokens not yet shown."""
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
        if self._stream is not None:  # its window starts afresh too
            self._stream = DecodeStream(skip_special_tokens=True)
        self.text += delta
        return delta
