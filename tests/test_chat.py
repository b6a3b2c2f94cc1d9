"""ChatService on the real default model (tiny max_tokens): token-id continuity, alternatives,
forks, stop, user isolation."""

import asyncio
import time

import pytest

from chatengine import AsyncLLM, SamplingParams
from chatengine.app.chat import MAX_REPLIES_PER_USER, ChatService, TurnTemplate
from chatengine.app.store import ChatStore, NotFound
from chatengine.personas import load_personas

GREEDY = dict(temperature=0, max_tokens=6)


class SpyEngine:
    """Delegates to an AsyncLLM and records every request (prompt ids, params, user)."""

    def __init__(self, engine):
        self.inner, self.calls = engine, []

    def __getattr__(self, name):  # the rest of the public API: as the engine has it
        return getattr(self.inner, name)

    def generate(self, prompt, params, *, request_id=None, user=None):
        self.calls.append(dict(prompt=list(prompt), params=params, user=user, request_id=request_id))
        return self.inner.generate(prompt, params, request_id=request_id, user=user)

    async def abort(self, request_id):
        await self.inner.abort(request_id)


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncLLM(max_num_batched_tokens=512, kv_cache_gib=0.25)
    yield engine
    engine.shutdown()


@pytest.fixture
def svc(async_engine, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    service = ChatService(SpyEngine(async_engine), store, load_personas())
    yield service
    # every request of the test has left the engine and holds no KV block
    inner = async_engine.engine
    deadline = time.monotonic() + 5
    while (
        inner.requests or inner.block_manager.num_free_blocks != inner.block_manager.num_blocks
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not inner.requests
    assert inner.block_manager.num_free_blocks == inner.block_manager.num_blocks
    store.close()


def run(agen_factory):
    """Drain an async generator of ReplyUpdates; return the last one."""

    async def go():
        last = None
        async for up in agen_factory():
            last = up
        return last

    return asyncio.run(go())


def test_turn_template_matches_full_rendering(svc):
    tpl = svc.template
    assert tpl.incremental, "SmolLM2's ChatML template must concatenate turn by turn"
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <there> & `x`"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again?"},
    ]
    ids = (
        tpl.system_ids("Be brief.")
        + tpl.user_ids(msgs[1]["content"])
        + tpl.assistant_ids_from_text("Hello!")
        + tpl.user_ids("Again?")
    )
    assert ids == svc.engine.apply_chat_template(msgs)
    # generated ids that end with the end-of-turn token get only the newline after it
    end = tpl.close_ids[0]
    assert tpl.assistant_ids([5, 6, end]) == [5, 6] + tpl.close_ids
    assert tpl.assistant_ids([5, 6]) == [5, 6] + tpl.close_ids


def test_token_ids_continuity_across_turns(svc):
    user = "alice"
    cid = svc.new_conversation(user, persona="assistant")
    first = run(lambda: svc.send(user, cid, "What is 2+2?", GREEDY))
    assert first.status == "done" and first.texts[0]
    second = run(lambda: svc.send(user, cid, "And 3+3?", GREEDY))
    assert second.status == "done"
    p1, p2 = svc.engine.calls[0]["prompt"], svc.engine.calls[1]["prompt"]
    store = svc.store
    path = store.active_path(user, cid)
    assert [m["role"] for m in path] == ["system", "user", "assistant", "user", "assistant"]
    # what the model saw is exactly what is stored
    assert p1 == store.prompt_token_ids(user, path[1]["id"])
    assert p2 == store.prompt_token_ids(user, path[3]["id"])
    # the second prompt extends the first with the reply and the new turn (no re-tokenisation)
    assert p2[: len(p1)] == p1
    assert p2 == p1 + path[2]["token_ids"] + path[3]["token_ids"]
    # the first prompt is the model's own template rendering; the second is a faithful
    # continuation of it (same text; the reply's ids are the sampled ones)
    persona = svc.personas["assistant"].system_prompt
    texts = [{"role": "system", "content": persona}, {"role": "user", "content": "What is 2+2?"}]
    assert p1 == svc.engine.apply_chat_template(texts)
    texts += [{"role": "assistant", "content": path[2]["content"]}, {"role": "user", "content": "And 3+3?"}]
    rendered = svc.tokenizer.apply_chat_template(texts, tokenize=False, add_generation_prompt=True)
    assert svc.tokenizer.decode(p2) == rendered
    # the stored reply ids are the generated ids (closed like the template closes a turn)
    assert path[2]["token_ids"][-len(svc.template.close_ids) :] == svc.template.close_ids
    # stats of a reply
    st = path[4]["stats"]
    assert st["tokens"] >= 1 and st["prompt_tokens"] == len(p2) and "ttft_ms" in st
    assert svc.engine.calls[0]["user"] == user
    # persona on the first message; the title follows the first user message
    assert store.get_conversation(user, cid)["title"] == "What is 2+2?"


def test_second_turn_reuses_cached_blocks(svc):
    if not svc.engine.engine.config.enable_prefix_caching:
        pytest.skip("prefix caching is disabled")
    cid = svc.new_conversation("carol")
    run(lambda: svc.send("carol", cid, "Name a colour.", GREEDY))
    up = run(lambda: svc.send("carol", cid, "Another one?", GREEDY))
    assert up.num_cached_tokens > 0
    assert up.stats[0]["cached_tokens"] == up.num_cached_tokens


def test_missing_ids_are_rederived(svc):
    user = "alice"
    cid = svc.new_conversation(user)
    run(lambda: svc.send(user, cid, "Hello", GREEDY))
    path = svc.store.active_path(user, cid)
    reply = path[-1]
    want = svc.template.assistant_ids_from_text(reply["content"])
    # a reply stored without ids (e.g. written by another client) is re-templated from its text
    with svc.store._write() as db:
        db.execute("UPDATE messages SET token_ids = NULL WHERE id = ?", [reply["id"]])
    run(lambda: svc.send(user, cid, "Thanks", GREEDY))
    assert svc.store.get_message(user, reply["id"])["token_ids"] == want
    prompt = svc.engine.calls[-1]["prompt"]
    user_msg = svc.store.active_path(user, cid)[-2]
    assert prompt == svc.store.prompt_token_ids(user, user_msg["id"])


def test_regenerate_adds_sibling(svc):
    user = "alice"
    cid = svc.new_conversation(user)
    first = run(lambda: svc.send(user, cid, "Say hi.", dict(GREEDY, temperature=1.0, seed=1)))
    again = run(lambda: svc.regenerate(user, cid, first.message_ids[0], dict(GREEDY, temperature=1.0, seed=1)))
    assert again.status == "done"
    sibs = svc.store.siblings(user, first.message_ids[0])
    assert [s["id"] for s in sibs] == [first.message_ids[0], again.message_ids[0]]
    view = svc.view(user, cid)
    assert view[-1]["id"] == again.message_ids[0] and (view[-1]["k"], view[-1]["n"]) == (2, 2)
    # both replies answered the same prompt; the regenerated one used another seed
    assert svc.engine.calls[0]["prompt"] == svc.engine.calls[1]["prompt"]
    assert sibs[0]["settings"]["seed"] != sibs[1]["settings"]["seed"]
    # switching shows the first one again
    assert svc.switch(user, cid, again.message_ids[0], -1) == first.message_ids[0]
    assert svc.view(user, cid)[-1]["k"] == 1


def test_edit_forks(svc):
    user = "alice"
    cid = svc.new_conversation(user)
    run(lambda: svc.send(user, cid, "First question", GREEDY))
    run(lambda: svc.send(user, cid, "Second question", GREEDY))
    old = svc.view(user, cid)
    assert len(old) == 4
    up = run(lambda: svc.edit(user, cid, old[0]["id"], "Edited question", GREEDY))
    assert up.status == "done"
    new = svc.view(user, cid)
    assert [m["role"] for m in new] == ["user", "assistant"]
    assert new[0]["content"] == "Edited question" and (new[0]["k"], new[0]["n"]) == (2, 2)
    # the edited turn's prompt is the persona + the edited message only
    sys_ids = svc.store.active_path(user, cid)[0]["token_ids"]
    assert svc.engine.calls[-1]["prompt"] == sys_ids + svc.template.user_ids("Edited question")
    # the old branch survives: switching back shows its latest continuation
    svc.switch(user, cid, new[0]["id"], -1)
    assert [m["id"] for m in svc.view(user, cid)] == [m["id"] for m in old]


def test_n_alternatives_in_one_request(svc):
    user = "alice"
    cid = svc.new_conversation(user)
    up = run(lambda: svc.send(user, cid, "Tell me a word.", dict(temperature=1.0, max_tokens=5, n=2, seed=7)))
    assert len(svc.engine.calls) == 1 and svc.engine.calls[0]["params"].n == 2
    assert up.status == "done" and len(up.message_ids) == 2
    sibs = svc.store.siblings(user, up.message_ids[0])
    assert [s["id"] for s in sibs] == up.message_ids
    assert all(s["status"] == "done" and s["token_ids"] for s in sibs)
    assert [s["content"] for s in sibs] == up.texts
    assert svc.view(user, cid)[-1]["n"] == 2


LONG = dict(temperature=0, max_tokens=400)
LONG_PROMPT = "Write a very long story about a dragon, at least 1000 words."


def test_stop_keeps_partial_reply(svc):
    user = "alice"
    cid = svc.new_conversation(user)

    async def go():
        last, stopper = None, None
        async for up in svc.send(user, cid, LONG_PROMPT, LONG):
            last = up
            if up.num_tokens[0] >= 3 and stopper is None:
                assert svc.is_generating(user, cid)
                # Stop comes from another task (the UI's Stop button is another event)
                stopper = asyncio.create_task(svc.stop(user, cid))
        assert await asyncio.wait_for(stopper, 5)
        return last

    t0 = time.monotonic()
    up = asyncio.run(go())
    assert time.monotonic() - t0 < 15
    assert up.status == "aborted"
    msg = svc.store.get_message(user, up.message_ids[0])
    assert msg["status"] == "aborted" and msg["content"] == up.texts[0] and msg["content"]
    assert msg["token_ids"][-len(svc.template.close_ids) :] == svc.template.close_ids
    assert not svc.is_generating(user, cid)
    # the conversation goes on after a stop
    assert run(lambda: svc.send(user, cid, "ok", GREEDY)).status == "done"


def test_a_reply_outlives_its_follower_and_a_late_follower_sees_it_live(svc):
    """The reply belongs to the server: the tab that asked for it leaves (a reload, another chat)
    and the reply goes on to its end; another tab of the user attaches and follows it from where
    it is; another user cannot attach."""
    user = "alice"
    cid = svc.new_conversation(user)

    async def go():
        gen = svc.send(user, cid, LONG_PROMPT, dict(temperature=0, max_tokens=24))
        async for first in gen:
            if first.num_tokens[0] >= 2:
                break  # the first tab leaves
        assert svc.is_generating(user, cid)
        with pytest.raises(NotFound):
            svc.attach("bob", cid)
        late = [up async for up in svc.attach(user, cid)]  # a second tab opens the chat
        return first, late

    first, late = asyncio.run(go())
    assert late[0].texts[0].startswith(first.texts[0]) and late[0].status == "streaming"
    final = late[-1]
    assert final.status == "done" and final.num_tokens[0] == 24 and final.finish_reasons == ["length"]
    msg = svc.store.get_message(user, final.message_ids[0])
    assert msg["status"] == "done" and msg["content"] == final.texts[0]
    assert not svc.is_generating(user, cid) and svc.attach(user, cid) is None


def test_a_server_shutdown_marks_the_reply_interrupted(svc):
    """Only the server's end cancels a generation: its partial text is kept as "interrupted"."""
    user = "alice"
    cid = svc.new_conversation(user)

    async def go():
        async for up in svc.send(user, cid, LONG_PROMPT, LONG):
            if up.num_tokens[0] >= 2:
                return up  # the loop ends with the generation still running: asyncio.run cancels it

    up = asyncio.run(go())
    msg = svc.store.get_message(user, up.message_ids[0])
    assert msg["status"] == "interrupted" and msg["content"].startswith(up.texts[0])
    assert not svc.is_generating(user, cid)


def test_continue_a_reply_cut_at_max_tokens(svc):
    """Continue writes into the same message; its prompt is the history plus the ids the reply
    generated (not its text re-tokenized, nor the close of its turn)."""
    user = "alice"
    cid = svc.new_conversation(user)
    cut = run(lambda: svc.send(user, cid, LONG_PROMPT, dict(temperature=0, max_tokens=6)))
    assert cut.finish_reasons == ["length"]
    generated = svc.store.get_message(user, cut.message_ids[0])["token_ids"][: -len(svc.template.close_ids)]
    more = run(lambda: svc.continue_reply(user, cid, cut.message_ids[0], dict(temperature=0, max_tokens=6)))
    assert more.message_ids == cut.message_ids and more.status == "done"
    assert more.texts[0].startswith(cut.texts[0]) and len(more.texts[0]) > len(cut.texts[0])
    assert svc.engine.calls[-1]["prompt"] == svc.engine.calls[0]["prompt"] + generated
    msg = svc.store.get_message(user, cut.message_ids[0])
    assert msg["content"] == more.texts[0] and msg["stats"]["tokens"] == 12 and msg["status"] == "done"
    assert msg["token_ids"][: len(generated)] == generated and len(svc.view(user, cid)) == 2
    # only a reply cut at max tokens, of this user, in this conversation
    done = svc.store.add_message(user, cid, "assistant", "Hi.", cut.user_message_id, stats={"finish_reason": "stop"})
    with pytest.raises(ValueError, match="cut at max tokens"):
        svc.continue_reply(user, cid, done)
    with pytest.raises(NotFound):
        svc.continue_reply(user, cid, cut.user_message_id)
    with pytest.raises(NotFound):
        svc.continue_reply("bob", cid, cut.message_ids[0])


def test_users_are_isolated(svc):
    cid = svc.new_conversation("alice")
    up = run(lambda: svc.send("alice", cid, "My secret is 42.", GREEDY))
    mid = up.message_ids[0]
    user_mid = up.user_message_id
    bob = "bob"
    assert svc.list_conversations(bob) == []
    assert svc.list_conversations(bob, "secret") == []
    for call in (
        lambda: svc.view(bob, cid),
        lambda: svc.get_conversation(bob, cid),
        lambda: svc.send(bob, cid, "hi", GREEDY),
        lambda: svc.regenerate(bob, cid, mid, GREEDY),
        lambda: svc.edit(bob, cid, user_mid, "x", GREEDY),
        lambda: svc.switch(bob, cid, mid, 1),
        lambda: svc.rename_conversation(bob, cid, "mine"),
        lambda: svc.delete_conversation(bob, cid),
        lambda: asyncio.run(svc.stop(bob, cid)),
    ):
        with pytest.raises(NotFound):
            call()
    # bob's own conversation cannot reach alice's messages either
    bcid = svc.new_conversation(bob)
    with pytest.raises(NotFound):
        svc.regenerate(bob, bcid, mid, GREEDY)
    with pytest.raises(NotFound):
        svc.switch(bob, bcid, mid, 1)
    assert [c["id"] for c in svc.list_conversations("alice")] == [cid]
    assert svc.view("alice", cid)[-1]["content"] == up.texts[0]
    assert {c["user"] for c in svc.engine.calls} == {"alice"}


def test_bad_input_writes_nothing(svc):
    user = "alice"
    cid = svc.new_conversation(user)
    before = len(svc.store.active_path(user, cid))
    with pytest.raises(ValueError):
        svc.send(user, cid, "   ", GREEDY)
    with pytest.raises(ValueError):
        svc.send(user, cid, "hi", dict(GREEDY, temperature=-1))
    with pytest.raises(ValueError):
        svc.send(user, cid, "hi", dict(GREEDY, n=10_000))
    with pytest.raises(ValueError, match="context"):
        svc.send(user, cid, "hello " * 9000, GREEDY)
    with pytest.raises(ValueError):
        svc.new_conversation(user, persona="no-such-persona")
    assert len(svc.store.active_path(user, cid)) == before
    assert svc.engine.calls == []


def test_template_fallback_renders_full_text():
    """A template whose turns do not concatenate is rendered whole (no stored ids)."""

    class Odd:
        eos_token_id = 0

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            raise RuntimeError("no template")

    class OddEngine:
        eos_token_ids: set[int] = set()

        def get_tokenizer(self):
            return Odd()

    assert TurnTemplate(OddEngine()).incremental is False


def test_one_turn_at_a_time_per_conversation(svc):
    """A second send, regenerate or edit while a reply streams in that conversation is refused with
    words (it would build on a reply still being written); other conversations are not held up."""
    user = "alice"
    cid, other = svc.new_conversation(user), svc.new_conversation(user)
    first = svc.send(user, cid, "Tell me a story.", GREEDY)  # claimed now, before it streams
    with pytest.raises(ValueError, match="still being written"):
        svc.send(user, cid, "And another thing", GREEDY)
    with pytest.raises(ValueError, match="still being written"):
        svc.regenerate(user, cid, None, GREEDY)
    assert len(svc.store.active_path(user, cid)) == 2  # system + the first user turn: nothing added
    assert run(lambda: svc.send(user, other, "Hi", GREEDY)).status == "done"
    assert run(lambda: first).status == "done"
    again = run(lambda: svc.send(user, cid, "And another thing", GREEDY))
    assert again.status == "done"
    assert [m["role"] for m in svc.store.active_path(user, cid)] == ["system", "user", "assistant", "user", "assistant"]


def test_a_user_has_at_most_four_replies_being_written_at_once(svc):
    """A fifth turn while four replies of the same user run elsewhere is refused with words and
    writes nothing; other users are not held up, and a finished reply frees a place."""
    user = "alice"
    cids = [svc.new_conversation(user) for _ in range(MAX_REPLIES_PER_USER + 1)]
    replies = [svc.send(user, cid, "Tell me a story.", GREEDY) for cid in cids[:-1]]  # claimed now
    with pytest.raises(ValueError, match=f"{MAX_REPLIES_PER_USER} of your replies are being written"):
        svc.send(user, cids[-1], "Hi", GREEDY)
    assert len(svc.store.active_path(user, cids[-1])) == 1  # the system prompt only: nothing added
    bob = svc.new_conversation("bob")
    assert run(lambda: svc.send("bob", bob, "Hi", GREEDY)).status == "done"
    assert run(lambda: replies[0]).status == "done"
    assert run(lambda: svc.send(user, cids[-1], "Hi", GREEDY)).status == "done"
    for reply in replies[1:]:
        assert run(lambda reply=reply: reply).status == "done"


# ---- a full disk: refused in words, nothing half-written ------------------------------------------
def fill_disk(store, monkeypatch):
    """Make `store` as full as a full disk: every connection (open or opened later) may not grow the
    file past its current size, so a write that needs a new page fails as ENOSPC would (SQLITE_FULL)."""
    import sqlite3

    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    real_connect = sqlite3.connect

    def limited(*a, **k):
        conn = real_connect(*a, **k)
        conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    store.close()  # every thread reopens through `limited`
    monkeypatch.setattr(sqlite3, "connect", limited)


@pytest.mark.slow  # fills a disk image: left out of CI, run with the whole suite (README)
def test_a_full_disk_refuses_a_message_in_words_and_keeps_nothing(svc, monkeypatch):
    from chatengine.app.store import StoreWriteError

    cid = svc.new_conversation("alice")
    run(lambda: svc.send("alice", cid, "Hi"))
    before = svc.view("alice", cid)
    fill_disk(svc.store, monkeypatch)
    with pytest.raises(StoreWriteError, match="the server's disk is full: nothing was saved"):
        svc.send("alice", cid, "A long message. " * 400)  # 6,400 characters: needs new pages
    assert svc.view("alice", cid) == before  # rolled back: no half-written turn
    assert not svc._claims and not svc.is_generating("alice", cid)  # the conversation is not left locked


def test_a_reply_that_cannot_be_saved_says_so_and_frees_the_conversation(svc, monkeypatch):
    from chatengine.app.store import StoreWriteError

    cid = svc.new_conversation("alice")
    real_update = svc.store.update_message

    def full(user, mid, **cols):
        if cols.get("status"):  # the final save of the reply
            raise StoreWriteError("the server's disk is full: nothing was saved. Tell whoever runs this server.")
        return real_update(user, mid, **cols)

    monkeypatch.setattr(svc.store, "update_message", full)
    last = run(lambda: svc.send("alice", cid, "Hi", dict(max_tokens=4)))
    assert last.status == "error" and last.error.startswith("this reply could not be saved: the server's disk is full")
    reply = svc.view("alice", cid)[-1]
    assert reply["status"] == "error" and "disk is full" in reply["stats"]["error"]  # not "streaming" forever
    assert not svc.is_generating("alice", cid) and not svc._claims
    monkeypatch.setattr(svc.store, "update_message", real_update)
    assert run(lambda: svc.send("alice", cid, "Again", dict(max_tokens=4))).status == "done"


def test_deleting_a_conversation_drops_its_cached_pages(svc, async_engine):
    """Every branch's private pages leave the cache; the public persona prefix stays shared."""
    user = "dora"
    cid = svc.new_conversation(user)
    first = run(lambda: svc.send(user, cid, "Name three colours and say why you like them.", GREEDY))
    run(lambda: svc.regenerate(user, cid, first.message_ids[0], dict(GREEDY, temperature=1.0, seed=3)))
    assert len(svc.store.leaves(user, cid)) == 2  # two branches
    prompt = svc.engine.calls[-1]["prompt"]
    public = async_engine.engine.public_prefix_len(prompt) // 16 * 16

    def cached() -> int:
        async def go():
            async for out in async_engine.generate(prompt, SamplingParams(max_tokens=1), user=user):
                pass
            return out.num_cached_tokens

        return asyncio.run(go())

    assert cached() > public  # the conversation's own pages hit
    svc.delete_conversation(user, cid)
    assert cached() == public  # (the forget runs on the engine's thread before the next request)


@pytest.mark.parametrize(
    "text, title",
    [
        ("What is 2+2?", "What is 2+2?"),
        ("\n\n  # Trip to Rome\nPlan four days for me.", "Trip to Rome"),
        ("- buy milk\n- buy eggs", "buy milk"),
        ("> quoted   words\nmore", "quoted words"),
        ("Write a very long story about a dragon, at least 1000 words.", "Write a very long story about a dragon, at…"),
        ("x" * 100, "x" * 47 + "…"),
    ],
)
def test_a_new_chat_is_titled_by_the_first_line_of_its_first_message(text, title):
    from chatengine.app.chat import TITLE_CHARS, _title_from

    assert _title_from(text) == title and len(title) <= TITLE_CHARS
