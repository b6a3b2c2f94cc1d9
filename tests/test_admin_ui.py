"""The Admin tab's handlers called as methods: every action is refused to non-admins on the server
(as a direct call through Gradio's queue would be), and works for admins; the New persona form."""

from types import SimpleNamespace

import pytest

gr = pytest.importorskip("gradio")

from chatengine.app.chat import ChatService  # noqa: E402
from chatengine.app.persona_catalog import PersonaCatalog  # noqa: E402
from chatengine.app.store import ChatStore  # noqa: E402
from chatengine.app.ui.admin import NEW, AdminUI, build_admin  # noqa: E402
from chatengine.app.ui.components import build_components  # noqa: E402
from chatengine.app.ui.handlers import ChatUI  # noqa: E402
from chatengine.app.users import AdminSet, UserDirectory  # noqa: E402
from chatengine.personas import Persona  # noqa: E402

SEEDS = {"assistant": Persona("assistant", "Assistant", "Helpful", "You are helpful.")}


class FakeEngine:
    """Enough engine for ChatService's constructor and the catalog (no generation here)."""

    max_model_len, max_prompt_chars, max_tokens_limit, max_n, eos_token_ids = 2048, 16384, 2048, 4, {0}
    model_id = "fake"

    def __init__(self):
        self.registered = {}

    def register_persona(self, name, prompt):
        self.registered[name] = prompt

    def unregister_persona(self, name):
        self.registered.pop(name, None)

    def get_tokenizer(self):
        return None


@pytest.fixture
def admin_ui(tmp_path, monkeypatch):
    import chatengine.app.chat as chat

    monkeypatch.setattr(chat, "TurnTemplate", lambda engine: SimpleNamespace(incremental=False))
    store = ChatStore(tmp_path / "chat.db")
    accounts = UserDirectory(store, iterations=1000)
    accounts.add("root", "root password", admin=True)
    accounts.add("bob", "bob password")
    catalog = PersonaCatalog(store, FakeEngine(), SEEDS)
    service = ChatService(FakeEngine(), store, catalog=catalog)
    with gr.Blocks() as demo:
        c = build_components(service.personas, service.default_persona, "t", 4)
        ui = ChatUI(service, c, auth_enabled=True, admins=AdminSet(accounts))
        build_admin(ui, c, accounts, catalog, demo)
    handlers = next(f.fn.__self__ for f in demo.fns.values() if isinstance(getattr(f.fn, "__self__", None), AdminUI))
    yield handlers
    store.close()


def request(user: str, session: str | None = None):
    return SimpleNamespace(username=user, session_hash=session or f"s-{user}")


def admin_actions(h: AdminUI, req):
    """Every admin handler, called as a direct API call would call it."""
    return [
        lambda: h.add_user("mallory2", "password123", True, req),
        lambda: h.pick_user("root", req),
        lambda: h.disable("root", req),
        lambda: h.enable("bob", req),
        lambda: h.reset_password("root", "takeover123", req),
        lambda: h.create_key("root", req),
        lambda: h.revoke_key("root", "abcd", req),
        lambda: h.pick_persona("assistant", req),
        lambda: h.delete_persona("assistant", req),
    ]


def test_every_admin_action_is_refused_to_a_non_admin(admin_ui):
    h = admin_ui
    for action in admin_actions(h, request("bob")):
        with pytest.raises(gr.Error, match="admins"):
            action()
    import asyncio

    with pytest.raises(gr.Error, match="admins"):
        asyncio.run(h.save_persona(NEW, "Evil", "", "Leak everything.", True, request("bob")))
    # nothing changed
    assert not h.accounts.exists("mallory2") and h.accounts.verify_password("root", "root password")
    assert h.accounts.all_users()[1]["keys"] == [] and "assistant" in h.catalog.visible("bob")
    assert [p.title for p in h.catalog.visible("bob").values()] == ["Assistant"]


def test_a_disabled_admin_is_refused_too(admin_ui):
    h = admin_ui
    h.accounts.set_disabled("root", True)
    with pytest.raises(gr.Error):
        h.add_user("carol", "password123", False, request("root"))


def test_on_load_shows_the_admin_tab_to_admins_only(admin_ui):
    h = admin_ui
    assert h.on_load(request("root"))[h.a.tab]["visible"] is True
    bob = h.on_load(request("bob"))
    assert bob[h.a.tab]["visible"] is False and h.a.users_table not in bob  # no user list for bob


def test_an_admin_adds_a_user_who_can_sign_in_and_gets_a_key(admin_ui):
    h, root = admin_ui, request("root")
    out = h.add_user("carol", "carol password", False, root)
    assert ["carol", "", "", "yes", ""] in out[h.a.users_table]["value"]
    assert h.accounts.verify_password("carol", "carol password")
    key = h.create_key("carol", root)[h.a.new_key]
    assert h.accounts.user_for_api_key(key) == "carol"
    h.disable("carol", root)
    assert not h.accounts.verify_password("carol", "carol password")
    h.enable("carol", root)
    assert h.reset_password("carol", "brand new pw", root) == ""
    assert h.accounts.verify_password("carol", "brand new pw")
    (key_id,) = h.accounts.all_users()[1]["keys"]
    h.revoke_key("carol", key_id, root)
    assert h.accounts.user_for_api_key(key) is None


def test_bad_input_warns_and_keeps_the_form(admin_ui):
    h, root = admin_ui, request("root")
    with pytest.warns(UserWarning, match="user name"):
        out = h.add_user("<script>", "carol password", False, root)
    assert out[h.a.new_password] == gr.skip()  # the password box keeps what was typed
    with pytest.warns(UserWarning, match="yourself"):
        h.disable("root", root)
    assert h.accounts.is_active("root")


def test_an_admin_makes_a_public_persona_a_user_makes_a_private_one(admin_ui):
    import asyncio

    h = admin_ui

    async def no_warm(key):  # the engine's warm-up is tested with a real engine in test_persona_catalog
        return 0

    h.catalog.warm = no_warm
    picker, chat_picker = asyncio.run(h.save_persona(NEW, "Pirate", "Arr", "You are a pirate.", True, request("root")))
    pirate = chat_picker["value"]
    assert pirate in h.catalog.visible("bob") and h.catalog.engine.registered[pirate] == "You are a pirate."
    choices = h.create_private("Diary", "mine", "You keep bob's diary.", request("bob"))[0]
    diary = choices["value"]
    assert ("Diary", diary) in choices["choices"]
    assert diary in h.catalog.visible("bob") and diary not in h.catalog.visible("root")
    assert diary not in h.catalog.engine.registered
    assert all(v != diary for _, v in h.on_load(request("root"))[h.ui.c.persona]["choices"])
    # the admin's editor lists public personas and their own, never bob's private one
    assert all(v != diary for _, v in h.admin_personas("root", NEW)["choices"])
    # a new chat named with bob's key (a direct call) opens on the default, with nothing of bob's
    opened = h.ui.new_chat(diary, request("root"))[h.ui.c.persona]
    assert opened["value"] == "assistant" and opened["info"] != "mine"
    assert h.ui.new_chat(diary, request("bob"))[h.ui.c.persona]["info"] == "mine"
    with pytest.warns(UserWarning, match="may not contain"):
        assert h.create_private("<b>x</b>", "", "p", request("bob")) == [gr.skip()] * 4
