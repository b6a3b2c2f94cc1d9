"""Chats on several models: a conversation keeps the model it was started with (across a reopen of
the store), its turns go to that model's engine under that model's chat template, and the UI's
handlers pick the model of a new chat and keep an open chat's own."""

import asyncio
import time
from types import SimpleNamespace

import pytest

gr = pytest.importorskip("gradio")

from chatengine import AsyncLLM  # noqa: E402
from chatengine.app.model_chats import ModelChats, ModelNotServed  # noqa: E402
from chatengine.app.models import ServedModels, UnknownModel  # noqa: E402
from chatengine.app.store import ChatStore  # noqa: E402
from chatengine.app.ui.components import build_components  # noqa: E402
from chatengine.app.ui.handlers import ChatUI  # noqa: E402
from chatengine.personas import load_personas  # noqa: E402

A = "alice"
GREEDY = dict(temperature=0, top_p=1, max_tokens=3, seed=None, n=1)


@pytest.fixture(scope="module")
def models(tiny_chat_model):
    a = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1)
    b = AsyncLLM(str(tiny_chat_model), max_num_batched_tokens=256, kv_cache_gib=0.05)
    yield ServedModels.of([a, b])
    a.shutdown()
    b.shutdown()


@pytest.fixture
def chats(models, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    yield ModelChats.build(models, store, load_personas())
    store.close()


def run(gen):
    async def go():
        return [u async for u in gen][-1]

    return asyncio.run(go())


def generated(models, grown_from: dict | None = None, model: str | None = None) -> dict:
    """Each engine's generated tokens; with `grown_from`, once `model`'s published count (every
    0.2 s, or at rest) has grown past it: a reply can reach its caller before the engine publishes."""
    deadline = time.monotonic() + 5.0
    while True:
        counts = {mid: e.stats()["num_generated_tokens"] for mid, e in models.items()}
        if grown_from is None or counts[model] > grown_from[model] or time.monotonic() > deadline:
            return counts
        time.sleep(0.02)


def templated_by_tiny(chats, cid) -> bool:
    """Whether the conversation's user turn holds the tiny model's own template ("user says")."""
    user = next(m for m in chats.store.active_path(A, cid) if m["role"] == "user")
    tokenizer = chats.for_model(chats.ids[1]).engine.get_tokenizer()
    return "user says" in tokenizer.decode(user["token_ids"])


def test_a_chat_keeps_its_model_and_its_turns_go_to_that_engine(models, chats, tmp_path):
    default, tiny = chats.ids
    cid = chats.new_conversation(A, "assistant", model=tiny)
    before = generated(models)
    assert run(chats.send(A, cid, "Hello", GREEDY)).status == "done"
    after = generated(models, before, tiny)
    assert after[tiny] > before[tiny] and after[default] == before[default]
    assert templated_by_tiny(chats, cid)
    chats.store.close()  # the server restarts: the chat is still the tiny model's
    again = ModelChats.build(models, ChatStore(tmp_path / "chat.db"), load_personas())
    try:
        assert again.get_conversation(A, cid)["model"] == tiny and again.model_of(A, cid) == tiny
        assert again.for_conversation(A, cid) is again.for_model(tiny)
        assert run(again.send(A, cid, "More", GREEDY)).status == "done"
        later = generated(models, after, tiny)
        assert later[tiny] > after[tiny] and later[default] == before[default]
    finally:
        again.store.close()


def test_a_new_chat_without_a_model_is_the_defaults(chats):
    cid = chats.new_conversation(A)
    assert chats.get_conversation(A, cid)["model"] == chats.default_id
    old = chats.store.create_conversation(A)  # from before conversations remembered their model
    assert chats.for_conversation(A, old) is chats.default


@pytest.mark.parametrize("name", ["nope", "../x", "dummy:tiny"])
def test_an_unknown_model_creates_nothing(chats, name):
    with pytest.raises(UnknownModel, match="choose one of"):
        chats.new_conversation(A, model=name)
    assert chats.list_conversations(A) == []


def test_a_chat_of_a_model_no_longer_served_is_kept_but_not_answered(chats):
    cid = chats.store.create_conversation(A, model="gone-model")
    chats.store.add_message(A, cid, "user", "hi", None)
    with pytest.raises(ModelNotServed, match="gone-model.*serves"):
        chats.send(A, cid, "Hello", GREEDY)
    assert [m["content"] for m in chats.view(A, cid)] == ["hi"]  # readable
    assert not chats.is_generating(A, cid)
    chats.delete_conversation(A, cid)
    assert chats.list_conversations(A) == []


# ---- the UI's handlers ---------------------------------------------------------------------------
def request(user=A, session="s1"):
    return SimpleNamespace(username=user, session_hash=session)


def drain(agen) -> list:
    async def go():
        return [x async for x in agen]

    return asyncio.run(go())


@pytest.fixture
def ui(chats):
    with gr.Blocks():
        c = build_components(chats.personas, chats.default_persona, "t", 4, models=chats.ids)
    return ChatUI(chats, c, auth_enabled=True, admins=frozenset({A}))


def send(ui, text, conv_id=None, model=None):
    return drain(ui.send(text, conv_id, "assistant", 0, 1, 3, -1, 1, request(), model))


def test_the_picker_shows_only_with_several_models(chats):
    with gr.Blocks():
        two = build_components(chats.personas, chats.default_persona, "t", 4, models=chats.ids)
        one = build_components(chats.personas, chats.default_persona, "t", 4, models=chats.ids[:1])
    assert two.model.visible and two.engine_model.visible
    assert not one.model.visible and not one.engine_model.visible


def test_the_ui_sends_a_new_chat_to_the_picked_model_and_keeps_it(ui, models):
    c, (default, tiny) = ui.c, ui.service.ids
    updates = send(ui, "Hello", model=tiny)
    cid = updates[0][c.cid]
    assert ui.service.get_conversation(A, cid)["model"] == tiny
    assert updates[0][c.model]["value"] == tiny and updates[0][c.model]["interactive"] is False
    assert templated_by_tiny(ui.service, cid)
    # the picker now says the default: this chat still talks to the tiny model
    before = generated(models)
    send(ui, "And again", conv_id=cid, model=default)
    after = generated(models, before, tiny)
    assert after[tiny] > before[tiny] and after[default] == before[default]
    opened = drain(ui.open_conv(cid, request()))[0]
    assert opened[c.model]["value"] == tiny and opened[c.model]["interactive"] is False
    fresh = ui.new_chat("assistant", request())
    assert fresh[c.model]["interactive"] is True and "value" not in fresh[c.model]  # the last pick stays


def test_the_ui_refuses_an_unknown_model_and_creates_nothing(ui):
    assert send(ui, "Hello", model="../../etc/passwd") == [gr.skip()]
    assert ui.service.list_conversations(A) == []


def test_the_engine_tab_shows_each_models_own_pool(ui, models):
    default, tiny = ui.service.ids
    totals = {mid: models[mid].stats()["kv_blocks_total"] for mid in (default, tiny)}
    assert totals[default] != totals[tiny]
    for mid in (default, tiny):
        html = asyncio.run(ui.engine_tick(request(), mid))[ui.c.kv_html]
        assert f"/{totals[mid]}<" in html or f"/{totals[mid]} " in html, mid
    with pytest.raises(gr.Error, match="not served here"):
        asyncio.run(ui.engine_tick(request(), "nope"))


def test_the_picker_labels_are_short_unless_two_would_look_alike():
    from chatengine.app.ui.components import model_choices

    assert model_choices(["/m/tiny-a", "Qwen/Qwen3-8B", "dummy:tiny"]) == [
        ("tiny-a", "/m/tiny-a"),
        ("Qwen3-8B", "Qwen/Qwen3-8B"),
        ("dummy:tiny", "dummy:tiny"),
    ]
    assert model_choices(["/a/model", "/b/model/"]) == [("/a/model", "/a/model"), ("/b/model/", "/b/model/")]
