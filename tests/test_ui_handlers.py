"""ChatUI's handlers called as methods, without HTTP: what each returns, keyed by component."""

import asyncio
import gc
import time
from types import SimpleNamespace

import pytest

gr = pytest.importorskip("gradio")

from chatengine import AsyncLLM  # noqa: E402
from chatengine.app.chat import ChatService  # noqa: E402
from chatengine.app.store import ChatStore  # noqa: E402
from chatengine.app.ui.components import build_components  # noqa: E402
from chatengine.app.ui.handlers import ChatUI, settings_of  # noqa: E402
from chatengine.personas import load_personas  # noqa: E402

GREEDY = (0, 1, 6, -1, 1)  # temperature, top_p, max_tokens, seed, n


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM(max_num_batched_tokens=512, kv_cache_gib=0.25)
    # as the server does after start-up: what the process built so far (here also earlier test files'
    # objects) is out of the collector's sight, so a full collection cannot pause the loop-lag checks
    gc.collect()
    gc.freeze()
    yield engine
    gc.unfreeze()
    engine.shutdown()


@pytest.fixture
def ui(engine, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    service = ChatService(engine, store, load_personas())
    with gr.Blocks():
        c = build_components(service.personas, service.default_persona, "t", 4)
    yield ChatUI(service, c, auth_enabled=True, admins=frozenset({"root"}))
    store.close()


def request(user: str, session: str = "s1"):
    return SimpleNamespace(username=user, session_hash=session)


def drain(agen) -> list:
    async def go():
        return [x async for x in agen]

    return asyncio.run(go())


def send(ui, user, text, conv_id=None, session="s1"):
    return drain(ui.send(text, conv_id, "assistant", *GREEDY, request(user, session)))


def test_settings_of_maps_the_form():
    assert settings_of(0.5, 0.9, 12.0, -1, 2.0) == dict(temperature=0.5, top_p=0.9, max_tokens=12, seed=None, n=2)
    assert settings_of(0, 1, 8, 7, 1)["seed"] == 7 and settings_of(0, 1, 8, "", 1)["seed"] is None


def test_login_required_when_auth_is_on(ui):
    with pytest.raises(gr.Error):
        ui.who(SimpleNamespace(username=None, session_hash="s"))
    assert ui.who(request("alice")) == "alice"


def test_a_tabs_session_serves_only_its_user(ui):
    assert ui.who(request("alice", "tab-a")) == "alice"
    with pytest.raises(gr.Error, match="another sign-in"):
        ui.who(request("bob", "tab-a"))  # bob replaying alice's session hash
    with pytest.raises(gr.Error):
        send(ui, "bob", "hi", session="tab-a")
    assert ui.who(request("bob", "tab-b")) == "bob"


def test_send_streams_then_renders_the_stored_turn(ui):
    c = ui.c
    updates = send(ui, "alice", "Say hi.")
    first, last = updates[0], updates[-1]
    conv_id = first[c.cid]
    assert conv_id and first[c.msg] == ""
    assert first[c.chatbot][-1] == {"role": "assistant", "content": "▍"}  # the waiting bubble
    assert first[c.rows][-1] is None
    rows = last[c.rows]
    assert len(rows) == 2 and None not in rows  # the user turn and its reply
    assert last[c.focus] == rows[-1]
    assert [r["role"] for r in last[c.chatbot]] == ["user", "assistant"]
    assert "tokens" in last[c.chatbot][-1]["content"]  # the stats footer
    assert last[c.conv_list]["value"] == conv_id
    assert ui.following == {}  # no reply left followed
    assert last[c.send_btn]["visible"] is True and last[c.stop_btn]["visible"] is False


def test_empty_message_changes_nothing(ui):
    assert send(ui, "alice", "   ") == [gr.skip()]


def test_another_users_conversation_is_not_found(ui):
    c = ui.c
    conv_id = send(ui, "alice", "Hello")[0][c.cid]
    [out] = drain(ui.open_conv(conv_id, request("bob", "s2")))
    assert out[c.cid] is None and out[c.chatbot] == [] and out[c.rows] == []
    menu = ui.chat_menu(conv_id, request("bob", "s2"))  # no title, no links, no menu
    assert menu[c.menu_btn]["visible"] is False and menu[c.rename_box] == "" and menu[c.export_html] == ""
    [opened] = drain(ui.open_conv(conv_id, request("alice")))
    assert opened[c.cid] == conv_id and len(opened[c.rows]) == 2
    assert opened[c.send_btn]["visible"] is True  # nothing is being written there


def test_a_reply_goes_on_when_its_tab_leaves_and_another_tab_follows_it(ui):
    """Tab 1 sends, then opens a new chat mid-reply: its event ends at once (the tab is free) and
    the reply goes on. Tab 2 of the same user opens the chat: Stop shows, the reply streams from
    where it is, then its final state; bob's tab gets nothing of it."""
    c = ui.c

    async def go():
        tab1 = ui.send("Tell me a long story.", None, "assistant", 0, 1, 24, -1, 1, request("alice", "t1"))
        sent = await anext(tab1)
        conv_id = sent[c.cid]
        assert sent[c.stop_btn]["visible"] is True
        while True:  # until some text shows
            upd = await anext(tab1)
            if "▍" in upd[c.chatbot][-1]["content"] and len(upd[c.chatbot][-1]["content"]) > 8:
                break
        ui.new_chat("assistant", request("alice", "t1"))  # tab 1 moves on...
        left = [u async for u in tab1]  # ...and stops following at once, without a final render
        assert ui.service.is_generating("alice", conv_id)
        assert ui.buttons_now(None, request("alice", "t1"))[c.send_btn]["visible"] is True
        assert ui.buttons_now(conv_id, request("alice", "t2"))[c.stop_btn]["visible"] is True
        [bob] = [u async for u in ui.open_conv(conv_id, request("bob", "b1"))]
        tab2 = [u async for u in ui.open_conv(conv_id, request("alice", "t2"))]
        return conv_id, left, bob, tab2

    conv_id, left, bob, tab2 = asyncio.run(go())
    assert left == []
    assert bob[c.cid] is None and bob[c.chatbot] == []
    first, last = tab2[0], tab2[-1]
    assert first[c.cid] == conv_id and first[c.stop_btn]["visible"] is True
    assert "▍" in first[c.chatbot][-1]["content"]  # live, from where the reply is
    assert "▍" not in last[c.chatbot][-1]["content"] and "24 tokens" in last[c.chatbot][-1]["content"]
    assert "stopped" not in last[c.chatbot][-1]["content"]
    assert last[c.send_btn]["visible"] is True and last[c.stop_btn]["visible"] is False
    reply = ui.service.view("alice", conv_id)[-1]
    assert reply["status"] == "done" and reply["stats"]["tokens"] == 24
    assert ui.following == {}


def test_stop_in_one_chat_leaves_the_other_streaming(ui):
    """Send / Stop belong to the chat: X streams while Y sends and finishes; Stop in X stops X."""
    c = ui.c

    async def go():
        tab = request("alice", "t1")
        x = ui.send("Tell me a long story.", None, "assistant", 0, 1, 400, -1, 1, tab)
        x_id = (await anext(x))[c.cid]
        await anext(x)
        ui.new_chat("assistant", tab)
        assert [u async for u in x] == []
        y = [u async for u in ui.send("Say hi.", None, "assistant", *GREEDY, tab)]
        assert ui.service.is_generating("alice", x_id)  # X still streams after Y is done
        stopped = await ui.stop(x_id, tab)
        return x_id, y, stopped

    x_id, y, stopped = asyncio.run(go())
    assert "tokens" in y[-1][c.chatbot][-1]["content"] and y[-1][c.send_btn]["visible"] is True
    assert stopped[c.send_btn]["visible"] is True
    assert not ui.service.is_generating("alice", x_id)
    assert ui.service.view("alice", x_id)[-1]["status"] == "aborted"


def test_regenerate_then_switch_versions(ui):
    c = ui.c
    last = send(ui, "alice", "Pick a colour.")[-1]
    conv_id, reply = ui.viewing["s1"], last[c.focus]
    regen = drain(ui.regenerate(conv_id, reply, 1.0, 1, 6, 3, 1, request("alice")))[-1]
    assert "**2 / 2**" in regen[c.alt_label]["value"]
    shown = regen[c.chatbot][-1]["content"]  # the reply carries its own ‹ 2/2 ›: back is live, next is not
    assert f"<span class='ver-nav vm-{regen[c.focus]}'>" in shown and "<span class='ver-count'>2/2</span>" in shown
    assert shown.count("ver-on") == 1 and "ver-prev ver-on" in shown
    back = ui.step_version(conv_id, f"{regen[c.focus]}:-1:1700000000", request("alice"))
    assert "**1 / 2**" in back[c.alt_label]["value"] and back[c.rows][-1] == reply
    assert "<span class='ver-count'>1/2</span>" in back[c.chatbot][-1]["content"]
    assert ui.step_version(conv_id, f"{reply}:-1", request("alice"))[c.rows][-1] == reply  # clamped at 1
    for bad in ("", "x", f"{reply}:2", f"{reply}:-1'><img", "../etc:1"):
        assert isinstance(ui.step_version(conv_id, bad, request("alice")), type(gr.skip()))
    with pytest.warns(UserWarning, match="does not exist"):  # bob cannot step alice's messages
        assert isinstance(ui.step_version(conv_id, f"{reply}:1", request("bob", "s2")), type(gr.skip()))


def test_n_alternatives_stream_side_by_side(ui):
    c = ui.c
    # 8 tokens each: a step (~0.1 s for three rows) outlasts the 80 ms throttle, so every token repaints
    ups = drain(ui.send("Name a fruit.", None, "assistant", 1.0, 1, 8, 5, 3, request("alice")))
    live = [u for u in ups if u.get(c.alt_label) == "Generating 3 alternatives…"]
    assert live, "no streaming update"
    bubbles = live[-1][c.chatbot][1:]
    assert len(bubbles) == 3 and [f"{k}/3" in b["content"] for k, b in enumerate(bubbles, 1)] == [True] * 3
    final = ups[-1]
    assert len(final[c.chatbot]) == 2 and "<span class='ver-count'>1/3</span>" in final[c.chatbot][-1]["content"]


def test_rename_and_delete(ui):
    c = ui.c
    conv_id = send(ui, "alice", "Hello")[0][c.cid]
    listed = ui.rename(conv_id, "My chat", request("alice"))
    assert ("My chat", conv_id) in listed["choices"]
    out = ui.delete(conv_id, "assistant", request("alice"))
    assert out[c.cid] is None and out[c.confirm_row]["visible"] is False
    assert all(cid != conv_id for _, cid in out[c.conv_list]["choices"])


def test_engine_tick_draws_the_pool_for_admins_only(ui):
    out = asyncio.run(ui.engine_tick(request("root", "s9")))
    assert "kv-grid" in out[ui.c.kv_html] and set(out) == {ui.c.kv_html, ui.c.hit_plot, ui.c.thr_plot}
    with pytest.raises(gr.Error, match="admins"):
        asyncio.run(ui.engine_tick(request("alice")))


def test_the_engine_tab_shows_for_admins_and_the_local_user(ui):
    c = ui.c
    assert asyncio.run(ui.on_load(request("alice")))[c.engine_tab]["visible"] is False
    assert asyncio.run(ui.on_load(request("root", "s9")))[c.engine_tab]["visible"] is True
    local = ChatUI(ui.service, c)  # no sign-in: the one local user runs the server
    assert asyncio.run(local.on_load(SimpleNamespace(username=None, session_hash="s")))[c.engine_tab]["visible"]


async def _loop_lag(stop: asyncio.Event) -> float:
    """The longest time this loop kept a 5 ms sleeper waiting beyond its 5 ms."""
    worst = 0.0
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(0.005)
        worst = max(worst, time.monotonic() - t - 0.005)
    return worst


def test_a_huge_message_is_refused_before_tokenizing_and_stalls_no_one(ui):
    """Mallory pastes 4 MB while Alice's reply streams: Mallory gets a clear refusal and nothing is
    stored; Alice's stream never waits (before, the 4 MB were tokenized on the event loop)."""
    c = ui.c

    async def go():
        gaps, stop = [], asyncio.Event()

        async def alice():
            last = None
            async for _ in ui.send("Tell me a long story.", None, "assistant", 0, 1, 48, -1, 1, request("alice", "a")):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
            stop.set()

        async def mallory():
            await asyncio.sleep(0.2)
            return [x async for x in ui.send("x" * 4_000_000, None, "assistant", *GREEDY, request("mallory", "m"))]

        lag = asyncio.create_task(_loop_lag(stop))
        _, refused = await asyncio.gather(alice(), mallory())
        return gaps, refused, await lag

    gaps, refused, lag = asyncio.run(go())
    assert refused == [gr.skip()]  # the box keeps the text; a warning says why
    assert ui.service.list_conversations("mallory") == []
    assert len(gaps) >= 3 and max(gaps) < 1.0, gaps
    assert lag < 0.25, lag
    with pytest.raises(ValueError, match="4,000,000 characters long"):
        ui.service.send("mallory", ui.service.new_conversation("mallory"), "x" * 4_000_000)
    assert c.msg is not None


def test_store_writes_run_off_the_event_loop(ui, monkeypatch):
    """A slow disk (every SQLite write takes 0.3 s) slows the writer's own turn, not the loop that
    streams everyone's replies."""
    store = ui.service.store
    for name in ("add_message", "update_message", "create_conversation", "rename_conversation"):
        real = getattr(store, name)

        def slow(*a, _real=real, **k):
            time.sleep(0.3)
            return _real(*a, **k)

        monkeypatch.setattr(store, name, slow)

    async def go():
        stop = asyncio.Event()
        lag = asyncio.create_task(_loop_lag(stop))
        updates = [x async for x in ui.send("Say hi.", None, "assistant", *GREEDY, request("alice"))]
        stop.set()
        return updates, await lag

    updates, lag = asyncio.run(go())
    assert len(updates[-1][ui.c.rows]) == 2  # the turn completed and was stored
    assert lag < 0.2, lag


def test_max_tokens_starts_chat_sized_within_the_context(ui):
    """The page's Max tokens starts at the server's default reply length, held within the model's
    context, which is also where the slider ends."""
    from chatengine.app.ui.layout import build_ui

    limit = ui.service.engine.max_tokens_limit
    for default, want in ((2048, min(2048, limit)), (10 * limit, limit), (None, limit)):
        demo = build_ui(ui.service, default_max_tokens=default)
        [slider] = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "max-tokens"]
        assert (slider.value, slider.maximum) == (want, limit)


def test_continue_writes_more_into_a_reply_cut_at_max_tokens(ui):
    c = ui.c
    last = send(ui, "alice", "Write a very long story about a dragon.")[-1]  # greedy, 6 tokens: cut
    assert "cut at max tokens" in last[c.chatbot][-1]["content"]
    assert last[c.continue_btn]["interactive"] is True
    conv_id, reply = ui.viewing["s1"], last[c.focus]
    final = drain(ui.continue_reply(conv_id, reply, *GREEDY, request("alice")))[-1]
    assert final[c.rows] == last[c.rows] and final[c.focus] == reply  # the same reply, longer
    assert "12 tokens" in final[c.chatbot][-1]["content"]
    assert final[c.chatbot][-1]["content"].startswith(last[c.chatbot][-1]["content"].split("\n\n")[0])
    refused = drain(ui.continue_reply(conv_id, last[c.rows][0], *GREEDY, request("alice")))  # a user message
    assert refused == [gr.skip()]


def test_a_reload_reopens_the_chat_in_the_url_with_its_settings(ui):
    """The address bar's ?c=<id> opens that chat when the page loads, and the settings of its last
    turn come back on the sliders (seed -1 when it was random)."""
    c = ui.c
    conv_id = drain(ui.send("Say hi.", None, "assistant", 0.3, 0.8, 6, 42, 2, request("alice")))[0][c.cid]
    [out] = drain(ui.open_from_url(conv_id, request("alice", "reloaded")))
    assert out[c.cid] == out[c.url_cid] == conv_id
    assert [m["role"] for m in out[c.chatbot]] == ["user", "assistant"]
    got = (out[c.temperature], out[c.top_p], out[c.max_tokens], out[c.seed], out[c.n_alt])
    assert got == (0.3, 0.8, 6, 42, 2)
    drain(ui.regenerate(conv_id, None, *GREEDY, request("alice")))  # the latest turn's settings win
    [out] = drain(ui.open_conv(conv_id, request("alice", "reloaded")))
    assert (out[c.temperature], out[c.max_tokens], out[c.seed], out[c.n_alt]) == (0, 6, -1, 1)


def test_a_url_to_someone_elses_chat_shows_nothing_and_says_not_found(ui):
    c = ui.c
    conv_id = send(ui, "alice", "alice's secret")[0][c.cid]
    with pytest.warns(UserWarning, match="not found"):
        [out] = drain(ui.open_from_url(conv_id, request("bob", "s2")))
    assert out[c.cid] is None and out[c.url_cid] == "" and out[c.chatbot] == []
    assert "secret" not in repr(out) and c.temperature not in out
    assert drain(ui.open_from_url("", request("bob", "s2"))) == [gr.skip()]  # no ?c=: the page as it was


def test_the_menu_pins_renames_and_links_exports_of_the_open_chat(ui):
    c = ui.c
    first = send(ui, "alice", "First chat")[0][c.cid]
    second = send(ui, "alice", "Second chat")[0][c.cid]
    menu = ui.chat_menu(first, request("alice"))
    assert menu[c.menu_btn]["visible"] is True and menu[c.rename_box] == "First chat" and menu[c.pin_btn] == "Pin"
    assert f"export/{first}.md" in menu[c.export_html] and f"export/{first}.json" in menu[c.export_html]
    out = ui.toggle_pin(first, request("alice"))
    assert out[c.pin_btn] == "Unpin"
    labels = [label for label, _ in out[c.conv_list]["choices"]]
    assert labels == ["\u2060Pinned", "First chat", "\u2060Today", "Second chat"]
    assert ui.chat_menu(first, request("alice"))[c.pin_btn] == "Unpin"
    assert ui.toggle_pin(first, request("alice"))[c.pin_btn] == "Pin"
    listed = ui.rename(second, "  Renamed  ", request("alice"))
    assert ("Renamed", second) in listed["choices"]


def test_pin_rename_and_delete_of_someone_elses_chat_change_nothing(ui):
    c = ui.c
    conv_id = send(ui, "alice", "Mine")[0][c.cid]
    with pytest.warns(UserWarning, match="not found"):
        out = ui.toggle_pin(conv_id, request("bob", "s2"))
    assert c.pin_btn not in out and all(v != conv_id for _, v in out[c.conv_list]["choices"])
    with pytest.warns(UserWarning, match="not found"):
        ui.rename(conv_id, "stolen", request("bob", "s2"))
    with pytest.warns(UserWarning, match="not found"):
        ui.delete(conv_id, "assistant", request("bob", "s2"))
    conv = ui.service.get_conversation("alice", conv_id)
    assert (conv["title"], conv["pinned"]) == ("Mine", False)


def test_a_bad_title_is_said_in_words_and_kept_out(ui):
    c = ui.c
    conv_id = send(ui, "alice", "Keep me")[0][c.cid]
    for bad in ("   ", "x" * 500):
        with pytest.warns(UserWarning, match="Not renamed"):
            ui.rename(conv_id, bad, request("alice"))
    assert ui.service.get_conversation("alice", conv_id)["title"] == "Keep me"


def test_a_heading_of_the_list_opens_nothing(ui):
    assert drain(ui.open_conv("group:Today", request("alice"))) == [gr.skip()]


def test_a_search_too_long_is_said_in_words(ui):
    with pytest.warns(UserWarning, match="Search:"):
        assert ui.on_search("q" * 1000, None, request("alice")) == gr.skip()


def test_a_setting_changed_by_hand_stays_with_the_chat_and_keeps_its_place(ui):
    c = ui.c
    older = send(ui, "alice", "Older")[0][c.cid]
    newer = send(ui, "alice", "Newer")[0][c.cid]
    ui.save_settings(older, 1.2, 0.5, 9, 7, 3, request("alice"))
    [out] = drain(ui.open_conv(older, request("alice")))
    assert (out[c.temperature], out[c.top_p], out[c.max_tokens], out[c.seed], out[c.n_alt]) == (1.2, 0.5, 9, 7, 3)
    assert [v for _, v in ui.conv_choices("alice")][1:] == [newer, older]  # the list order stays
    with pytest.warns(UserWarning, match="not saved"):
        ui.save_settings(older, 0.5, 2.0, 9, 7, 1, request("alice"))  # top-p out of range: said, not stored
    with pytest.warns(UserWarning, match="not saved"):
        ui.save_settings(older, 0.5, 0.5, 9, 7, 1, request("bob", "s2"))  # not bob's
    assert ui.service.get_conversation("alice", older)["settings"]["temperature"] == 1.2
