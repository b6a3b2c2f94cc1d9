"""The tokenizer helpers: the chat template as the model has it, message validation, and an
incremental detokenizer whose deltas never split a character."""

import pytest

from chatengine.engine.tokenizer import IncrementalDetokenizer, apply_chat_template, encode, validate_messages


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def test_template_equals_the_models_own(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert apply_chat_template(tok, msgs) == list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    no_gen = apply_chat_template(tok, msgs, add_generation_prompt=False)
    assert apply_chat_template(tok, msgs)[: len(no_gen)] == no_gen and len(no_gen) < len(apply_chat_template(tok, msgs))


def test_encode_adds_no_special_tokens(tok):
    assert encode(tok, "Hello world") == tok.encode("Hello world", add_special_tokens=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        encode(None, "x")
    with pytest.raises(ValueError, match="surrogate"):
        encode(tok, "bad \udc00")


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty list"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"role": "user", "content": 5}], "must be a string"),
    ],
)
def test_bad_messages_are_named(messages, message):
    with pytest.raises(ValueError, match=message):
        validate_messages(messages)


def test_detokenizer_never_splits_a_character(tok):
    text = "Snow ☃ and a family 👨‍👩‍👧 — naïve café, 日本語."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # at least one multi-byte character spans tokens and was held back until whole
    assert any(d == "" for d in deltas[:-1])


def test_detokenizer_fast_path_equals_transformers_decode(tok):
    """The Rust decode is taken for this tokenizer and gives transformers' text, special tokens skipped."""
    ids = tok.encode("<|im_start|>user\nHi ☃ there<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert detok._rust_decode is not None
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True) == "user\nHi ☃ there"


def test_detokenizer_without_a_tokenizer_gives_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.add(5) == "" and detok.flush() == "" and detok.text == ""


def _deltas(detok, ids):
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_detokenizer_stream_gives_the_decodes_deltas_and_flushes_a_cut_character(tok):
    """The Rust DecodeStream path gives each token the delta the two-decode window gives, and a text
    cut inside a multi-byte character flushes the same held-back tail (U+FFFD)."""
    text = "Snow ☃ and a family 👨‍👩‍👧 — naïve café, 日本語 " * 3
    ids = tok.encode(text, add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    for seq in (ids, ids[:cut]):
        fast = IncrementalDetokenizer(tok)
        assert fast._stream is not None
        slow = IncrementalDetokenizer(tok)
        slow._stream = None
        assert _deltas(fast, seq) == _deltas(slow, seq)
        assert fast._stream is not None  # the stream gave them all (no fallback)
        assert fast.text == slow.text == tok.decode(seq, skip_special_tokens=True)
    assert fast.text.endswith("\ufffd")


def test_detokenizer_after_a_flush_starts_a_fresh_window(tok):
    """Tokens added after a flush (which gave out a held-back partial character) are decoded from
    there, by the stream as by the decodes."""
    ids = tok.encode("日本語 and more", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    got = []
    for use_stream in (True, False):
        detok = IncrementalDetokenizer(tok)
        if not use_stream:
            detok._stream = None
        got.append([detok.add(i) for i in ids[:cut]] + [detok.flush()] + [detok.add(i) for i in ids[cut:]])
    assert got[0] == got[1]


def test_detokenizer_carries_on_by_decodes_when_the_stream_refuses(tok):
    ids = tok.encode("Snow ☃ and a family 👨‍👩‍👧 — naïve café", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids[:7]]

    class Refusing:
        def step(self, tokenizer, token_id):
            raise Exception("InvalidPrefix")

    detok._stream = Refusing()
    deltas += [detok.add(i) for i in ids[7:]] + [detok.flush()]
    assert detok._stream is None
    assert "".join(deltas) == detok.text == tok.decode(ids)
