"""ChatUI: every handler of the page, as methods over ChatService.

Each handler takes the user from ``gr.Request`` (``request.username`` when login is on, one local
user otherwise) and passes it to ChatService, which checks ownership in SQL: a conversation id of
someone else behaves exactly like an id that does not exist. Handlers return dicts keyed by
component (see components.py): what a handler leaves out keeps its value.

Streaming: a reply is a Generation that the server owns (see chat.py); a tab only follows it, in
async generators whose UI updates are throttled to ~80 ms (the engine batches every user; a browser
cannot paint faster than that anyway). A tab follows the reply of the chat it shows: sending,
regenerating or editing there, or opening a chat whose reply is still being written (after a
reload, in a second tab). When the tab opens another chat, reloads or closes, it stops following
and the reply goes on. Send / Stop follow the chat on screen: Stop while its reply is written.
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Container

import gradio as gr

from chatengine.app.chat import ChatService, NotFound
from chatengine.app.generation import Generation
from chatengine.app.model_chats import ModelChats
from chatengine.app.session_guard import SessionOwners
from chatengine.app.store import StoreWriteError
from chatengine.app.ui.components import Components
from chatengine.app.ui.monitor import EngineMonitor
from chatengine.app.ui.render import (
    can_continue,
    default_focus,
    export_links,
    kv_picture,
    nav_state,
    parse_version_step,
    persona_header,
    persona_placeholder,
    to_chat,
    unescape_html,
)
from chatengine.app.ui.sidebar import grouped_choices, is_heading

LOCAL_USER = "local"
THROTTLE_S = 0.08


def _index(data) -> int:
    """The row index of a chatbot event (Gradio gives an int or an [row, column] pair)."""
    return data.index if isinstance(data.index, int) else data.index[0]


def _session(request: gr.Request) -> str:
    """The tab's Gradio session (every event of a queued app has one)."""
    return str(request.session_hash)


def settings_of(temperature, top_p, max_tokens, seed, n) -> dict:
    """The generation settings as ChatService takes them (seed -1 or empty: random)."""
    seed = None if seed is None or seed == "" or float(seed) < 0 else int(seed)
    return dict(temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_tokens), seed=seed, n=int(n))


class ChatUI:
    def __init__(
        self,
        service: ChatService | ModelChats,
        c: Components,
        *,
        auth_enabled: bool = False,
        local_user: str = LOCAL_USER,
        admins: Container[str] = frozenset(),
    ):
        self.service, self.c = ModelChats.of(service), c  # one ChatService per served model
        self.auth_enabled, self.local_user = auth_enabled, local_user
        self.admins = admins  # who may see server-wide figures (the one local user always may)
        self.personas, self.default_persona = service.personas, service.default_persona
        self.monitors = {mid: EngineMonitor(svc.engine) for mid, svc in self.service.models.items()}
        self.viewing: dict[str, str | None] = {}  # session -> the conversation its tab shows
        self.following: dict[str, Generation] = {}  # session -> the reply its tab follows
        self.owners = SessionOwners()  # session -> its user: a tab's state serves no one else

    # ---- helpers --------------------------------------------------------------------------------
    def who(self, request: gr.Request | None) -> str:
        name = getattr(request, "username", None) if request is not None else None
        if not name:
            if self.auth_enabled:
                raise gr.Error("Please log in.")
            return self.local_user
        session = getattr(request, "session_hash", None)
        if session and not self.owners.admit(str(session), str(name)):
            raise gr.Error("This tab belongs to another sign-in: reload the page.")
        return str(name)

    def show(self, session: str, cid: str | None) -> None:
        """Record what the tab shows; a reply it was following elsewhere lets it go at once."""
        self.viewing[session] = cid
        gen = self.following.get(session)
        if gen is not None:
            gen.wake()

    def buttons(self, generating: bool) -> dict:
        """Send, or Stop while the chat on screen has a reply being written."""
        return {self.c.send_btn: gr.update(visible=not generating), self.c.stop_btn: gr.update(visible=generating)}

    def is_admin(self, user: str) -> bool:
        return not self.auth_enabled or user in self.admins

    def conv_choices(self, user: str, query: str | None = None) -> list[tuple[str, str]]:
        """The sidebar's chats under their headings (Pinned, Today, ...)."""
        return grouped_choices(self.service.list_conversations(user, (query or "").strip() or None))

    def conv_list(self, user: str, value: str | None) -> dict:
        return gr.update(choices=self.conv_choices(user), value=value)

    def header(self, persona_name: str | None) -> dict:
        text = persona_header(self.personas.get(persona_name or ""))
        return gr.update(value=text, visible=bool(text))

    def nav(self, view: list[dict], focus: str | None) -> dict:
        label = nav_state(view, focus)
        c = self.c
        return {
            c.alt_label: gr.update(value=label),
            c.regen_btn: gr.update(interactive=focus is not None),
            c.continue_btn: gr.update(interactive=can_continue(view, focus)),
        }

    def render(self, user: str, cid: str | None, focus: str | None = None) -> dict:
        """The transcript of conversation ``cid`` with its selection and ◀ k/N ▶ state."""
        view = self.service.view(user, cid) if cid else []
        focus = default_focus(view, focus)
        c = self.c
        return {c.chatbot: to_chat(view), c.rows: [m["id"] for m in view], c.focus: focus, **self.nav(view, focus)}

    def blank(self) -> dict:
        """An empty transcript with no selection."""
        c = self.c
        off = gr.update(interactive=False)
        return {
            c.chatbot: [],
            c.rows: [],
            c.focus: None,
            c.alt_label: "",
            c.regen_btn: off,
            c.continue_btn: off,
        }

    def waiting_view(self, user: str, cid: str) -> dict:
        """The new user message at once, with an empty reply bubble."""
        view = self.service.view(user, cid)
        c = self.c
        off = gr.update(interactive=False)
        return {
            c.chatbot: to_chat(view) + [{"role": "assistant", "content": "▍"}],
            c.rows: [m["id"] for m in view] + [None],
            c.focus: None,
            c.alt_label: "Waiting for the engine…",
            c.regen_btn: off,
            c.continue_btn: off,
        }

    # ---- page load / sidebar --------------------------------------------------------------------
    async def on_load(self, request: gr.Request) -> dict:  # async: runs on the server loop (the sampler task)
        user = self.who(request)
        for monitor in self.monitors.values():
            monitor.ensure_running()
        name = f"Signed in as **{html.escape(user)}**" if self.auth_enabled else ""
        c = self.c
        return {
            c.conv_list: await asyncio.to_thread(self.conv_list, user, None),
            c.who_md: name,
            c.logout_btn: gr.update(visible=self.auth_enabled),
            c.engine_tab: gr.update(visible=self.is_admin(user)),
        }

    def on_unload(self, request: gr.Request) -> None:
        self.show(_session(request), None)
        self.viewing.pop(_session(request), None)

    def new_chat(self, persona_name, request: gr.Request) -> dict:
        user = self.who(request)
        self.show(_session(request), None)
        visible = self.service.default.personas_for(user)  # never another user's private one by key
        name = persona_name if persona_name in visible else self.default_persona
        p = visible.get(name or "")
        c = self.c
        return {
            **self.blank(),
            c.cid: None,
            c.chatbot: gr.update(value=[], placeholder=persona_placeholder(p)),
            c.alt_label: gr.update(value=""),
            c.conv_list: gr.update(value=None),
            c.persona: gr.update(visible=True, value=name, info=p.description if p else None),
            c.model: self.model_picker(None),
            c.header: gr.update(visible=False),
            c.url_cid: "",
            **self.buttons(False),
        }

    def model_picker(self, model_id: str | None) -> dict:
        """The model picker: a new chat's choice (model_id None: the last pick stays), or the model an
        open chat keeps (fixed). Shown only when several models are served."""
        shown = len(self.service.ids) > 1
        if model_id is None:
            return gr.update(visible=shown, interactive=True, label="Model for this new chat")
        value = model_id if model_id in self.service.models else None  # not served now: sends are refused
        return gr.update(visible=shown, interactive=False, value=value, label="Model of this chat")

    async def open_conv(self, conv_id, request: gr.Request):
        """Show a conversation; if its reply is being written (by this tab before a reload, by another
        tab), follow it live from where it is to its end."""
        user = self.who(request)
        if not conv_id or is_heading(conv_id):
            yield gr.skip()
            return
        c, session = self.c, _session(request)
        try:
            conv, gen, out = await asyncio.to_thread(self._open, user, conv_id)
        except NotFound:  # someone else's chat looks exactly like one that does not exist
            gr.Warning("Chat not found: it was deleted, or this link is not to one of your chats.")
            yield {**self.blank(), c.cid: None, c.url_cid: "", c.conv_list: self.conv_list(user, None)}
            return
        self.show(session, conv_id)
        yield {
            **out,
            c.cid: conv_id,
            c.url_cid: conv_id,
            c.conv_list: gr.update(value=conv_id),  # marked in the list when opened by a link too
            c.persona: gr.update(visible=False),
            c.model: self.model_picker(conv["model"] or self.service.default_id),
            c.header: self.header(conv["persona"]),
            **self.settings_view(conv["settings"]),
            **self.buttons(gen is not None),
        }
        if gen is not None:
            async for upd in self.follow(user, conv_id, gen, session):
                yield upd

    def _open(self, user: str, conv_id: str):
        """(conversation, its running Generation or None, its transcript): live text while one runs."""
        conv = self.service.get_conversation(user, conv_id)
        gen = self.service.attach(user, conv_id)
        if gen is None or gen.version == 0:
            return conv, gen, self.render(user, conv_id) if gen is None else self.waiting_view(user, conv_id)
        return conv, gen, self._progress(self.service.view(user, conv_id), gen.snapshot())

    async def open_from_url(self, url_cid, request: gr.Request):
        """The chat named in the address bar (?c=<id>) when the page loads: a reload reopens it."""
        async for upd in self.open_conv(url_cid, request):
            yield upd

    def settings_view(self, settings: dict) -> dict:
        """The generation settings a chat keeps (those of its latest turn) back on the sliders; a chat
        without any leaves them as they are."""
        if not settings:
            return {}
        c, seed = self.c, settings.get("seed")
        values = {c.temperature: "temperature", c.top_p: "top_p", c.max_tokens: "max_tokens", c.n_alt: "n"}
        out = {comp: settings[key] for comp, key in values.items() if key in settings}
        if c.max_tokens in out:  # a server restarted with a shorter context has a shorter slider
            out[c.max_tokens] = min(out[c.max_tokens], self.service.engine.max_tokens_limit)
        return {**out, c.seed: -1 if seed is None else seed}

    def save_settings(self, conv_id, temperature, top_p, max_tokens, seed, n, request: gr.Request) -> None:
        """A setting changed by hand: kept with the open chat at once (a new chat keeps its settings
        from its first turn)."""
        user = self.who(request)
        if not conv_id:
            return
        try:
            settings = settings_of(temperature, top_p, max_tokens, seed, n)
            self.service.remember_settings(user, conv_id, settings, touch=False)
        except (NotFound, ValueError, TypeError, StoreWriteError) as e:  # TypeError: an emptied number box
            gr.Warning(f"These settings were not saved with the chat: {e}")

    def chat_menu(self, conv_id, request: gr.Request) -> dict:
        """The menu of the chat now open (closed; hidden without one): its title, Pin or Unpin, and
        links to download it."""
        user = self.who(request)
        c = self.c
        try:
            conv = self.service.get_conversation(user, conv_id) if conv_id else None
        except NotFound:
            conv = None
        if conv is None:
            hide = gr.update(visible=False)
            empty = {c.rename_box: "", c.pin_btn: "Pin", c.export_html: ""}
            return {c.menu_btn: hide, c.menu: hide, c.menu_open: False, c.confirm_row: hide, **empty}
        return {
            c.menu_btn: gr.update(visible=True),
            c.menu: gr.update(visible=False),
            c.menu_open: False,
            c.rename_box: conv["title"],
            c.pin_btn: "Unpin" if conv["pinned"] else "Pin",
            c.export_html: export_links(conv["id"]),
            c.confirm_row: gr.update(visible=False),
        }

    def toggle_pin(self, conv_id, request: gr.Request) -> dict:
        user = self.who(request)
        try:
            if not conv_id:
                raise NotFound("no chat open")
            pinned = not self.service.get_conversation(user, conv_id)["pinned"]
            self.service.set_pinned(user, conv_id, pinned)
        except NotFound:
            gr.Warning("Chat not found: open one of your chats first.")
            return {self.c.conv_list: self.conv_list(user, None)}
        except StoreWriteError as e:
            gr.Warning(str(e))
            return gr.skip()
        return {self.c.conv_list: self.conv_list(user, conv_id), self.c.pin_btn: "Unpin" if pinned else "Pin"}

    def on_search(self, query, current, request: gr.Request):
        user = self.who(request)
        try:
            return gr.update(choices=self.conv_choices(user, query), value=current)
        except ValueError as e:  # a query longer than any title
            gr.Warning(f"Search: {e}")
            return gr.skip()

    def on_persona(self, name, request: gr.Request) -> dict:
        p = self.service.default.personas_for(self.who(request)).get(name or "")  # never another user's private one
        return {
            self.c.persona: gr.update(info=p.description if p else None),
            self.c.chatbot: gr.update(placeholder=persona_placeholder(p)),
        }

    def rename(self, conv_id, new_title, request: gr.Request):
        user = self.who(request)
        if not conv_id:
            gr.Warning("Open a chat first.")
            return gr.skip()
        try:
            self.service.rename_conversation(user, conv_id, new_title)
        except NotFound:
            gr.Warning("Chat not found: it was deleted, or it is not one of your chats.")
        except (ValueError, StoreWriteError) as e:  # empty or too long a title; a full disk
            gr.Warning(f"Not renamed: {e}")
        return self.conv_list(user, conv_id)

    def delete(self, conv_id, persona_name, request: gr.Request) -> dict:
        user = self.who(request)
        if conv_id:
            try:
                self.service.delete_conversation(user, conv_id)
            except NotFound:
                gr.Warning("Chat not found: it was deleted, or it is not one of your chats.")
            except (ValueError, StoreWriteError) as e:  # a reply still streams there; a full disk
                gr.Warning(f"Not deleted: {e}")
                return {self.c.confirm_row: gr.update(visible=False)}
        return {
            **self.new_chat(persona_name, request),
            self.c.conv_list: self.conv_list(user, None),
            self.c.confirm_row: gr.update(visible=False),
        }

    # ---- streaming turns ------------------------------------------------------------------------
    def _progress(self, view: list[dict], up) -> dict:
        """The transcript while a reply streams: every alternative's text so far, one bubble each
        (k/N, in order) where the reply's place is."""
        shown, n = up.message_ids[0], len(up.message_ids)
        streaming = [
            dict(id=mid, role="assistant", content=up.texts[i], k=i + 1, n=n, stats=(up.stats or [{}] * n)[i])
            for i, mid in enumerate(up.message_ids)
        ]
        at = next((i for i, m in enumerate(view) if m["id"] == shown), len(view))
        view = view[:at] + streaming + view[at + 1 :]
        live = set(up.message_ids)
        rows = [row for m in view for row in to_chat([m], streaming_id=m["id"] if m["id"] in live else None)]
        c = self.c
        off = gr.update(interactive=False)
        label = f"Generating {n} alternatives…" if n > 1 else "Generating…"
        return {
            c.chatbot: rows,
            c.rows: [m["id"] for m in view],
            c.focus: shown,
            c.alt_label: label,
            c.regen_btn: off,
            c.continue_btn: off,
        }

    async def follow(self, user: str, conv_id: str, gen: Generation, session: str):
        """Paint a reply into this tab while the tab shows its conversation (throttled), then the
        stored state (statuses, stats, k/N). Leaving the chat ends only the painting."""
        self.following[session] = gen
        gen.start()
        seen, view = 0, None
        try:
            while not gen.finished:
                if self.viewing.get(session, conv_id) != conv_id:
                    return  # the tab moved on: the reply goes on without it
                if gen.version == seen:
                    await gen.changed(seen)
                    continue
                seen, up = gen.version, gen.snapshot()
                if view is None:
                    view = await asyncio.to_thread(self.service.view, user, conv_id)
                yield self._progress(view, up)
                await asyncio.sleep(THROTTLE_S)  # then the latest snapshot: no backlog of tokens
        finally:
            if self.following.get(session) is gen:
                del self.following[session]
        final = gen.snapshot()
        if final.status == "error":
            gr.Warning(final.error or "generation failed")
        focus_id = final.message_ids[0] if final.message_ids else None
        yield await asyncio.to_thread(self._ended_view, user, conv_id, focus_id)

    def _ended_view(self, user: str, conv_id: str, focus_id: str | None) -> dict:
        return {
            **self.render(user, conv_id, focus_id),
            self.c.conv_list: self.conv_list(user, conv_id),
            **self.buttons(self.service.is_generating(user, conv_id)),
        }

    def _start_send(self, user: str, text: str, conv_id, persona_name, settings: dict, model=None):
        """(conversation id, reply generator) of a new turn; a new chat that fails leaves nothing behind.
        A new chat talks to ``model`` (the picker's, a served id); an existing one keeps its own."""
        is_new = conv_id is None
        if is_new:
            conv_id = self.service.new_conversation(user, persona_name or self.default_persona, model=model or None)
        try:
            gen = self.service.send(user, conv_id, text, settings)
        except ValueError:
            if is_new:
                self.service.delete_conversation(user, conv_id)
            raise
        self.remember(user, conv_id, settings)
        return conv_id, gen

    def remember(self, user: str, conv_id: str, settings: dict) -> None:
        """Keep the turn's settings with the chat (they come back when it is reopened). The reply is
        already under way: a failed write is said in words and costs only this."""
        try:
            self.service.remember_settings(user, conv_id, settings)
        except (NotFound, ValueError, StoreWriteError) as e:
            gr.Warning(f"These settings were not saved with the chat: {e}")

    def _sent_view(self, user: str, conv_id: str) -> dict:
        conv = self.service.get_conversation(user, conv_id)
        c = self.c
        return {
            **self.waiting_view(user, conv_id),
            c.msg: "",
            c.cid: conv_id,
            c.url_cid: conv_id,
            c.conv_list: self.conv_list(user, conv_id),
            c.persona: gr.update(visible=False),
            c.model: self.model_picker(conv["model"] or self.service.default_id),
            c.header: self.header(conv["persona"]),
        }

    # the model picker comes last, after the request: its place does not move the form's inputs
    async def send(
        self, text, conv_id, persona_name, temperature, top_p, max_tokens, seed, n, request: gr.Request, model=None
    ):
        user = self.who(request)
        if not isinstance(text, str) or not text.strip():
            yield gr.skip()
            return
        try:  # tokenizing and SQLite in a worker thread: other users' streams run on this loop
            conv_id, gen = await asyncio.to_thread(
                self._start_send,
                user,
                text,
                conv_id,
                persona_name,
                settings_of(temperature, top_p, max_tokens, seed, n),
                model,
            )
        except NotFound:
            gr.Warning("That conversation does not exist; start a new chat.")
            yield gr.skip()
            return
        except (ValueError, StoreWriteError) as e:
            gr.Warning(str(e))
            yield gr.skip()
            return
        gen.start()  # at once: the reply no longer depends on this event
        self.show(_session(request), conv_id)
        yield {**await asyncio.to_thread(self._sent_view, user, conv_id), **self.buttons(True)}
        async for upd in self.follow(user, conv_id, gen, _session(request)):
            yield upd

    async def regenerate(self, conv_id, msg_id, temperature, top_p, max_tokens, seed, n, request: gr.Request):
        settings = settings_of(temperature, top_p, max_tokens, seed, n)
        async for upd in self._reply_to(self.service.regenerate, conv_id, msg_id, settings, request):
            yield upd

    async def continue_reply(self, conv_id, msg_id, temperature, top_p, max_tokens, seed, n, request: gr.Request):
        """More of a reply cut at max tokens, written into it (Max tokens more at most)."""
        settings = settings_of(temperature, top_p, max_tokens, seed, n)
        async for upd in self._reply_to(self.service.continue_reply, conv_id, msg_id, settings, request):
            yield upd

    async def _reply_to(self, start, conv_id, msg_id, settings: dict, request: gr.Request):
        """Start ``start(user, conv_id, msg_id, settings)`` (a Generation) and follow it."""
        user = self.who(request)
        if not conv_id:
            yield gr.skip()
            return
        try:
            gen = await asyncio.to_thread(start, user, conv_id, msg_id, settings)
            gen.start()
            await asyncio.to_thread(self.remember, user, conv_id, settings)
        except NotFound:
            gr.Warning("That message does not exist.")
            yield gr.skip()
            return
        except (ValueError, StoreWriteError) as e:
            gr.Warning(str(e))
            yield gr.skip()
            return
        async for upd in self.follow(user, conv_id, gen, _session(request)):
            yield upd

    async def retry(
        self, conv_id, row_ids, temperature, top_p, max_tokens, seed, n, data: gr.RetryData, request: gr.Request
    ):
        idx = _index(data)
        msg_id = row_ids[idx] if 0 <= idx < len(row_ids or []) else None
        async for out in self.regenerate(conv_id, msg_id, temperature, top_p, max_tokens, seed, n, request):
            yield out

    async def edit(
        self, conv_id, row_ids, temperature, top_p, max_tokens, seed, n, data: gr.EditData, request: gr.Request
    ):
        user = self.who(request)
        idx = _index(data)
        msg_id = row_ids[idx] if conv_id and 0 <= idx < len(row_ids or []) else None
        value = data.value
        if isinstance(value, list):  # normalized content parts
            value = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in value)
        try:
            if msg_id is None:
                raise NotFound("no such message")
            text, settings = unescape_html(str(value or "")), settings_of(temperature, top_p, max_tokens, seed, n)
            gen = await asyncio.to_thread(self.service.edit, user, conv_id, msg_id, text, settings)
            gen.start()
            await asyncio.to_thread(self.remember, user, conv_id, settings)
        except (NotFound, ValueError, StoreWriteError) as e:
            gr.Warning("That message does not exist." if isinstance(e, NotFound) else str(e))
            yield await asyncio.to_thread(self.render, user, conv_id) if conv_id else gr.skip()
            return
        yield await asyncio.to_thread(self.waiting_view, user, conv_id)
        async for upd in self.follow(user, conv_id, gen, _session(request)):
            yield upd

    async def stop(self, conv_id, request: gr.Request) -> dict:
        user = self.who(request)
        if conv_id:
            try:
                await self.service.stop(user, conv_id)
            except NotFound:
                gr.Warning("Chat not found: nothing to stop.")
        return self.buttons(False)

    def busy(self) -> dict:
        return self.buttons(True)

    def buttons_now(self, conv_id, request: gr.Request) -> dict:
        """Send or Stop for the chat the tab shows now (after a generating event ends, the tab may
        show another chat than the one it started in)."""
        user = self.who(request)
        return self.buttons(bool(conv_id) and self.service.is_generating(user, conv_id))

    # ---- alternatives ---------------------------------------------------------------------------
    def switch(self, conv_id, focus_id, step: int, request: gr.Request) -> dict:
        user = self.who(request)
        if not conv_id or not focus_id:
            return gr.skip()
        if self.service.is_generating(user, conv_id):
            gr.Warning("Wait for the reply to finish before switching versions.")
            return gr.skip()
        try:
            return self.render(user, conv_id, self.service.switch(user, conv_id, focus_id, step))
        except NotFound:
            gr.Warning("That message does not exist.")
            return gr.skip()

    def step_version(self, conv_id, cmd, request: gr.Request) -> dict:
        """A click on a message's inline ‹ or ›: show its previous or next version."""
        parsed = parse_version_step(cmd)
        if parsed is None:
            return gr.skip()
        return self.switch(conv_id, parsed[0], parsed[1], request)

    def on_select(self, conv_id, row_ids, data: gr.SelectData, request: gr.Request) -> dict:
        user = self.who(request)
        idx = _index(data)
        if not conv_id or not (0 <= idx < len(row_ids or [])) or row_ids[idx] is None:
            return gr.skip()
        if self.service.is_generating(user, conv_id):  # the stream owns the view and nav
            return gr.skip()
        try:
            view = self.service.view(user, conv_id)
        except NotFound:
            return gr.skip()
        return {self.c.focus: row_ids[idx], **self.nav(view, row_ids[idx])}

    # ---- engine tab -----------------------------------------------------------------------------
    async def engine_tick(self, request: gr.Request, model_id=None) -> dict:
        """The Engine tab's picture of one model's engine (its own KV pool): the tab's picker's, else
        the default."""
        if not self.is_admin(self.who(request)):  # the tab is hidden; this refuses a direct call too
            raise gr.Error("The Engine view is for admins.")
        monitor = self.monitors.get(model_id or self.service.default_id)
        if monitor is None:
            raise gr.Error("That model is not served here: pick one in the list.")
        monitor.ensure_running()
        hit_df, thr_df = monitor.frames()
        return {self.c.kv_html: kv_picture(monitor.stats()), self.c.hit_plot: hit_df, self.c.thr_plot: thr_df}
