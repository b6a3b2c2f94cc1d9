"""Logprobs in OpenAI's two shapes, from the engine's per-token dicts {token_id: logprob} (the top
candidates best first, then the sampled token when it is not among them).

- chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, exactly
  `top_logprobs` candidates per token;
- completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, the top `logprobs` candidates
  plus the sampled token (up to logprobs + 1 entries, as OpenAI says and vLLM does); a prompt's first
  token (echo) has null logprobs, as nothing predicts it.

Token strings are the token's own bytes read as UTF-8 (a token holding part of a character shows
U+FFFD, as vLLM's); `bytes` are the exact bytes. -inf (a masked token) is sent as -9999.0, as
OpenAI and vLLM do, since JSON has no infinity.
"""

import math

FLOOR = -9999.0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte is one printable character in a byte-level vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """The text and UTF-8 bytes of each token id of one tokenizer, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {i: getattr(t, "content", str(t)) for i, t in added.items()}
        self.byte_level = _is_byte_level(tokenizer)

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = None
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return self.tokenizer.decode([token_id]).encode("utf-8")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and ("ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder))


def _lp(value: float) -> float:
    return FLOOR if value == -math.inf or value < FLOOR else float(value)


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> list[dict]:
    """The `content` entries of chat logprobs for `token_ids`, each with its `top` best candidates."""
    content = []
    for token_id, candidates in zip(token_ids, logprobs):
        text, raw = texts.get(token_id)
        tops = []
        for i, (cand, lp) in enumerate(candidates.items()):
            if i >= top:
                break
            ctext, craw = texts.get(cand)
            tops.append({"token": ctext, "logprob": _lp(lp), "bytes": craw})
        content.append({"token": text, "logprob": _lp(candidates[token_id]), "bytes": raw, "top_logprobs": tops})
    return content


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float] | None], text_offset: int = 0
) -> dict:
    """Completions logprobs for `token_ids` (entries None: a prompt's first token); text_offset: where
    the first token starts in the choice's text. Offsets add up the tokens' texts, as vLLM's do."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token_id, candidates in zip(token_ids, logprobs):
        text = texts.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if candidates is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(candidates[token_id]))
        tops: dict[str, float] = {}
        for cand, lp in candidates.items():  # best first; two ids spelling the same text keep the better
            tops.setdefault(texts.text(cand), _lp(lp))
        out["top_logprobs"].append(tops)
    return out
