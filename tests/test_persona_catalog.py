"""PersonaCatalog: personas in SQLite seeded from prompts/, who sees and edits which, public ones
registered and warmed in the engine, private ones salted per user (never shared in the KV cache)."""

import asyncio

import pytest

from chatengine import AsyncLLM, SamplingParams
from chatengine.app.chat import ChatService
from chatengine.app.persona_catalog import PersonaCatalog
from chatengine.app.store import ChatStore, NotFound
from chatengine.engine.kv.hashing import hash_blocks
from chatengine.personas import Persona, load_personas

SEEDS = {
    "assistant": Persona("assistant", "Assistant", "Helpful", "You are helpful."),
    "cook": Persona("cook", "Cook", "Recipes", "You are a cook."),
}


class FakeEngine:
    """What the catalog asks of the engine, recorded."""

    def __init__(self):
        self.registered: dict[str, str] = {}

    def register_persona(self, name, system_prompt):
        self.registered[name] = system_prompt

    def unregister_persona(self, name):
        self.registered.pop(name, None)


@pytest.fixture
def catalog(store):
    return PersonaCatalog(store, FakeEngine(), SEEDS)


def test_files_seed_public_personas_and_are_registered(catalog):
    assert list(catalog.visible("anyone")) == ["assistant", "cook"]  # the default first
    assert catalog.engine.registered == {"assistant": "You are helpful.", "cook": "You are a cook."}


def test_an_unedited_seed_follows_its_file_an_edited_or_deleted_one_does_not(store, catalog):
    catalog.update("root", "cook", "Chef", "Edited", "You are a chef.", public=True, admin=True)
    changed = dict(SEEDS, cook=Persona("cook", "Cook 2", "R", "New file text."))
    again = PersonaCatalog(store, FakeEngine(), changed)
    assert again.get("cook").system_prompt == "You are a chef."  # the admin's edit wins
    catalog.delete("root", "cook", admin=True)
    assert "cook" not in PersonaCatalog(store, FakeEngine(), changed).visible("x")  # no comeback
    fresh = dict(SEEDS, assistant=Persona("assistant", "A", "d", "File changed."))
    assert PersonaCatalog(store, FakeEngine(), fresh).get("assistant").system_prompt == "File changed."
    with pytest.raises(ValueError, match="default"):
        catalog.delete("root", "assistant", admin=True)


def test_a_private_persona_is_its_owners_alone(catalog):
    key = catalog.create("alice", "Secret", "mine", "You know alice's secret.", admin=False)
    assert key in catalog.visible("alice") and key not in catalog.visible("bob")
    assert key not in catalog.engine.registered  # never a shared prefix
    assert key not in list(catalog.lookup)  # not listed for pages that do not know their user
    for admin in (False, True):  # another user's private persona does not exist for them, admins too
        with pytest.raises(NotFound):
            catalog.update("bob", key, "x", "", "y", public=False, admin=admin)
        with pytest.raises(NotFound):
            catalog.delete("bob", key, admin=admin)
    catalog.update("alice", key, "Secret 2", "", "Still private.", public=False, admin=False)
    assert catalog.get(key).title == "Secret 2"
    catalog.delete("alice", key, admin=False)
    assert catalog.get(key) is None


def test_only_admins_make_or_change_public_personas(catalog):
    with pytest.raises(PermissionError):
        catalog.create("bob", "Loud", "", "Shout.", public=True, admin=False)
    key = catalog.create("bob", "Quiet", "", "Whisper.", admin=False)
    with pytest.raises(PermissionError):
        catalog.update("bob", key, "Quiet", "", "Whisper.", public=True, admin=False)
    with pytest.raises(NotFound):  # seeds are not a user's to edit
        catalog.update("bob", "cook", "Mine", "", "x", public=False, admin=False)
    pub = catalog.create("root", "Pirate", "Arr", "You are a pirate.", public=True, admin=True)
    assert pub in catalog.visible("bob") and catalog.engine.registered[pub] == "You are a pirate."


def test_a_public_persona_made_private_or_deleted_is_no_longer_shared(store, catalog):
    pub = catalog.create("root", "Pirate", "Arr", "You are a pirate.", public=True, admin=True)
    catalog.update("root", pub, "Pirate", "Arr", "You are a pirate.", public=False, admin=True)
    assert pub not in catalog.engine.registered  # at once, not at the next restart
    catalog.update("root", "cook", "Cook", "", "You are a cook.", public=True, admin=True)
    catalog.delete("root", "cook", admin=True)
    assert "cook" not in catalog.engine.registered
    # the engine registers prompts/ at its start: the catalog takes back what is no longer public
    catalog.update("root", "assistant", "A", "", "You are helpful.", public=False, admin=True)
    engine = FakeEngine()
    engine.registered.update(assistant="You are helpful.", cook="You are a cook.")
    PersonaCatalog(store, engine, SEEDS)
    assert engine.registered == {}


@pytest.mark.parametrize(
    "title, description, prompt, needle",
    [
        ("", "d", "p", "title must not be empty"),
        ("x" * 61, "d", "p", "title is 61"),
        ("[click](javascript:alert(1))", "d", "p", "may not contain"),
        ("<img src=x onerror=alert(1)>", "d", "p", "may not contain"),
        ("ok", "![t](http://evil/x.png)", "p", "may not contain"),
        ("ok", "d", "   ", "system prompt must not be empty"),
        ("ok", "d", "p" * 8001, "system prompt is 8,001"),
        ("ok", "d", "\ud800", "not valid Unicode"),
        (None, "d", "p", "title must be text"),
    ],
)
def test_bad_persona_fields_are_refused_and_nothing_is_saved(catalog, title, description, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        catalog.create("alice", title, description, prompt, admin=False)
    assert list(catalog.visible("alice")) == ["assistant", "cook"]


# ---- with the real engine: warming and salting -----------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM(max_num_batched_tokens=512, kv_cache_gib=0.25)
    yield engine
    engine.shutdown()


def reply_stats(service, user, persona, text="Say one word."):
    async def go():
        cid = await asyncio.to_thread(service.new_conversation, user, persona)
        gen = service.send(user, cid, text, dict(temperature=0, max_tokens=2))
        gen.start()
        while not gen.finished:
            await gen.changed(gen.version)
        return service.view(user, cid)[-1]["stats"]

    return asyncio.run(go())


LONG_PROMPT = "You are a careful assistant who answers in short, plain sentences. " * 6


def test_a_private_persona_is_salted_per_user_and_a_public_one_is_shared_and_warmed(engine, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    catalog = PersonaCatalog(store, engine, load_personas())
    service = ChatService(engine, store, catalog=catalog)
    mine = catalog.create("alice", "Mine", "", LONG_PROMPT + "alice", admin=False)
    theirs = catalog.create("bob", "Theirs", "", LONG_PROMPT + "alice", admin=False)  # the same text
    with pytest.raises(ValueError, match="persona"):
        service.new_conversation("bob", mine)  # alice's persona is not bob's to pick
    first = reply_stats(service, "alice", mine)
    assert first["cached_tokens"] == 0
    assert reply_stats(service, "alice", mine)["cached_tokens"] >= 32  # alice hits her own prefix
    # bob's prompt has the same tokens, but his cache salt differs: none of alice's pages serve him
    assert reply_stats(service, "bob", theirs)["cached_tokens"] == 0
    # a public persona: warmed on save, so even its first user hits its prefix
    pub = catalog.create("root", "Shared", "", LONG_PROMPT + "everyone", public=True, admin=True)
    assert asyncio.run(catalog.warm(pub)) >= 32
    assert reply_stats(service, "carol", pub)["cached_tokens"] >= 32
    assert reply_stats(service, "dave", pub)["cached_tokens"] >= 32
    store.close()


# no leading block in common with LONG_PROMPT's personas (one of them stays registered as public)
SOON_PRIVATE = "An archivist who keeps the guild's ledgers answers in riddles and never in plain words. " * 5


def test_a_public_persona_made_private_stops_serving_its_prefix_to_other_users(engine, tmp_path):
    """The attacker's view: carol chatted with a public persona, an admin made it private (its owner
    alone sees it now), and dave sends the very same prompt: he must get no page of it, nor any
    page of carol's (his cache misses entirely)."""
    store = ChatStore(tmp_path / "chat.db")
    catalog = PersonaCatalog(store, engine, load_personas())
    service = ChatService(engine, store, catalog=catalog)
    pub = catalog.create("root", "Soon private", "", SOON_PRIVATE, public=True, admin=True)
    asyncio.run(catalog.warm(pub))
    assert reply_stats(service, "carol", pub)["cached_tokens"] >= 32
    ids = engine.apply_chat_template(
        [{"role": "system", "content": SOON_PRIVATE}, {"role": "user", "content": "Say one word."}]
    )
    catalog.update("root", pub, "Soon private", "", SOON_PRIVATE, public=False, admin=True)
    assert pub not in engine.engine.personas

    async def dave():
        out = None
        async for out in engine.generate(ids, SamplingParams(max_tokens=1), user="dave"):
            pass
        return out

    assert asyncio.run(dave()).num_cached_tokens == 0
    # the engine thread dropped the shared pages before it took dave's request (one inbox, in order)
    prefix = catalog.prefix_ids(engine, SOON_PRIVATE)
    shared = hash_blocks(engine.engine.block_manager.root, prefix, engine.engine.config.block_size)
    assert len(shared) >= 2 and not any(h in engine.engine.block_manager.cached for h in shared)
    assert reply_stats(service, "root", pub)["cached_tokens"] == 0  # salted for its owner from now on
    store.close()


def test_a_user_owns_at_most_max_per_user_personas(catalog, monkeypatch):
    import chatengine.app.persona_catalog as pc

    monkeypatch.setattr(pc, "MAX_PER_USER", 2)
    for i in range(2):
        catalog.create("alice", f"P{i}", "", "prompt", admin=False)
    with pytest.raises(ValueError, match="delete one first"):
        catalog.create("alice", "P2", "", "prompt", admin=False)
    catalog.create("bob", "P0", "", "prompt", admin=False)  # a cap per user, not for everyone
