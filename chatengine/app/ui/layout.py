"""The browser chat UI (Gradio 6 Blocks) on top of ChatService: the page and its wiring.

Layout: a sidebar (new chat, search, the user's conversations under date headings: sidebar.py;
a drawer on phones), a "Chat" tab (the open chat's menu: rename, pin, export, delete; persona picker
for a new chat, the transcript, ◀ k/N ▶ alternatives of the selected message,
regenerate, the input with Send / Stop, sampling settings) and an "Engine" tab (KV pages of the
device, CPU and disk tiers, hit rate and throughput over time; admins only when users sign in) and an
"Admin" tab (users and personas; admins only: admin.py).
Components are in components.py, handlers (one class) in handlers.py, what the page shows as text
in render.py. The address bar names the open chat (?c=<id>, see SET_URL / READ_URL).

Generating events have no per-event concurrency limit (the engine batches all users). Message
text is HTML-escaped outside code (and Gradio sanitizes the rest), so HTML or script in a message
shows as text and never runs.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import gradio as gr

from chatengine.app.chat import ChatService
from chatengine.app.model_chats import ModelChats
from chatengine.app.persona_catalog import PersonaCatalog
from chatengine.app.ui.admin import build_admin
from chatengine.app.ui.components import Components, build_components
from chatengine.app.ui.handlers import LOCAL_USER, ChatUI
from chatengine.app.users import UserDirectory

ENGINE: dict[str, Any] = dict(concurrency_limit=None, concurrency_id="engine")
QUIET: dict[str, Any] = dict(queue=False, api_visibility="private", show_progress="hidden")

CSS = """
#chat button[aria-label="Clear"] {display: none}
#chat {flex-grow: 1}
#chat .msg-stats {display: block; margin-top: .6em; font-size: .78em; opacity: .62;
                  font-family: var(--font-mono); letter-spacing: -.01em}
#chat .msg-stats .alt {font-weight: 600; opacity: 1}
#chat .msg-warn {color: var(--error-text-color, #c2410c)}
#nav-row {align-items: center; gap: .5em; flex-wrap: nowrap}
#alt-label {flex-grow: 1}
#alt-label p {margin: 0; font-size: .9em; opacity: .85}
#input-row {align-items: flex-end}
#input-row button {min-width: 6em; max-width: 8em}
#conv-list label {width: 100%}
#conv-list .wrap {flex-direction: column; gap: 2px}
#conv-list label span {white-space: nowrap; overflow: hidden; text-overflow: ellipsis; max-width: 250px}
#who p {margin: 0; font-size: .85em; opacity: .75}
.kv-grid {display: grid; grid-template-columns: repeat(auto-fill, 11px); gap: 2px; margin: .5em 0 1em}
.kv-cell {width: 11px; height: 11px; border-radius: 2px}
.kv-used {background: #6366f1} .kv-shared {background: #f59e0b} .kv-cached {background: #10b981}
.kv-free {background: #d1d5db} .kv-cpu {background: #0ea5e9} .kv-disk {background: #a855f7}
.kv-legend {display: flex; flex-wrap: wrap; gap: 1.2em; font-size: .9em; align-items: center}
.kv-legend .kv-cell {display: inline-block; vertical-align: middle; margin-right: .35em}
.kv-tiers {display: grid; grid-template-columns: repeat(auto-fit, minmax(170px, 1fr)); gap: .8em; margin-top: 1em}
.kv-tier {border: 1px solid var(--border-color-primary); border-radius: 8px; padding: .6em .8em}
.kv-tier b {font-size: 1.35em; display: block}
.kv-tier span {font-size: .8em; opacity: .7}
#conn-banner {position: fixed; top: 0; left: 0; right: 0; z-index: 100000; padding: .7em 1em; text-align: center;
              background: #fef3c7; color: #78350f; border-bottom: 1px solid #f59e0b; font-size: .95em}
#conn-banner button {margin-left: .4em; padding: .2em .9em; border-radius: 6px; border: 1px solid #b45309;
                     background: #fff; cursor: pointer}
body.conn-lost #stop {display: none}
.hidden-cmd {display: none !important}
#chat .ver-nav {font-weight: 600; opacity: 1; white-space: nowrap; user-select: none}
#chat .ver-step {display: inline-block; padding: 0 .45em; border-radius: 4px; opacity: .35}
#chat .ver-step.ver-on {cursor: pointer; opacity: 1}
#chat .ver-step.ver-on:hover {background: var(--background-fill-secondary)}
#conv-list label[data-testid^="\\2060"] {pointer-events: none; background: none !important; border: none !important;
  box-shadow: none !important; padding: .9em .3em .15em !important; margin: 0 !important; min-height: 0;
  font-size: .72em; font-weight: 600;
  text-transform: uppercase; letter-spacing: .05em; opacity: .6}
#conv-list label[data-testid^="\\2060"] input {display: none}
#chat-menu {border: 1px solid var(--border-color-primary); border-radius: 8px; padding: .6em}
#chat-menu .export-links a {text-decoration: underline; margin: 0 .2em}
@media (max-width: 768px) {
  /* Gradio's drawer is 100vw wide on phones: it hid the whole page. A narrower one leaves the
     chat in sight, and the page script closes it after a chat is picked. */
  #sidebar {width: min(300px, 85vw) !important; left: calc(-1 * min(300px, 85vw)) !important}
  #conv-list label span {max-width: 60vw}
  #input-row button {min-width: 4.5em}
  #nav-row {flex-wrap: wrap}
}
"""

# The server gone (stopped, crashed, the network): Gradio shows a toast and leaves the page as it
# was, "Generating…" and Stop included. This says so in words, marks the reply being shown, hides
# Stop (it cannot reach the server), and offers a reload once the server answers again. It starts
# from Gradio's own error toast (its heartbeat notices a lost server at once) and then asks /health
# every 2 s until the server is back.
JS = """
() => {
  const bar = document.createElement("div");
  bar.id = "conn-banner";
  bar.setAttribute("role", "alert");
  bar.hidden = true;
  document.body.prepend(bar);
  let lost = false, checking = false, poll = null;
  async function healthy() {
    try { return (await fetch("health", {cache: "no-store"})).ok; } catch (e) { return false; }
  }
  function markLost() {
    lost = true;
    document.body.classList.add("conn-lost");
    for (const el of document.querySelectorAll("#chat .msg-stats")) {
      if (el.textContent.includes("generating…")) {
        el.textContent = "⚠ connection lost";
        el.classList.add("msg-warn");
      }
    }
    const label = document.querySelector("#alt-label p");
    if (label) label.textContent = "";
    bar.textContent = "Connection to the server lost. A reply being written goes on if the server still "
      + "runs; reload this page once the server is back.";
    bar.hidden = false;
    poll = setInterval(check, 2000);
  }
  function markBack() {
    clearInterval(poll);
    bar.textContent = "The server is back.";
    const reload = document.createElement("button");
    reload.id = "conn-reload";
    reload.textContent = "Reload";
    reload.onclick = () => location.reload();
    bar.append(reload);
  }
  async function check() {
    if (checking) return;
    checking = true;
    const ok = await healthy();
    checking = false;
    if (!ok && !lost) markLost();
    else if (ok && lost && poll !== null) { markBack(); poll = null; }
  }
  new MutationObserver(() => {
    if (!lost && document.querySelector(".toast-body.error")) check();
  }).observe(document.body, {childList: true, subtree: true});
}
"""


# An inline ‹ or › (render.version_nav) is a span in a message: Gradio gives the chatbot no click
# events inside a message, so this catches the click first (capture phase, before the message's
# own select), writes "message id:step:nonce" into the hidden ver-cmd box and presses ver-go. The
# id is the nav's "vm-<id>" class (the sanitizer drops data attributes).
JS_VERSIONS = """
() => {
  document.addEventListener("click", (ev) => {
    const step = ev.target.closest && ev.target.closest("#chat .ver-step.ver-on");
    if (!step) return;
    ev.preventDefault();
    ev.stopPropagation();
    const nav = step.closest(".ver-nav");
    const cls = nav && [...nav.classList].find((c) => c.startsWith("vm-"));
    const box = document.querySelector("#ver-cmd textarea, #ver-cmd input");
    const go = document.querySelector("#ver-go");
    if (!cls || !box || !go) return;
    const dir = step.classList.contains("ver-prev") ? "-1" : "1";
    box.value = cls.slice(3) + ":" + dir + ":" + Date.now();
    box.dispatchEvent(new Event("input", {bubbles: true}));
    setTimeout(() => go.click(), 0);
  }, true);
}
"""


# On a phone the sidebar is a drawer over the chat: closed when the page opens and after a chat is
# picked or started (Gradio leaves it open). NARROW matches the width where Gradio's CSS makes it a
# drawer.
NARROW = 768
_CLOSE = f"""
const closeSidebar = () => {{
  if (window.innerWidth > {NARROW}) return false;
  const toggle = document.querySelector("#sidebar.open .toggle-button");
  if (toggle) toggle.click();
  return !!toggle;
}};
"""
JS_MOBILE = f"""
() => {{
  {_CLOSE}
  let tries = 0;  // the sidebar mounts after this script runs
  const timer = setInterval(() => {{
    if (closeSidebar() || document.querySelector("#sidebar:not(.open)") || ++tries > 50) clearInterval(timer);
  }}, 100);
}}
"""
# an event's js: closes the drawer, then hands the event's inputs on unchanged
CLOSE_SIDEBAR = f"(...args) => {{ {_CLOSE} closeSidebar(); return args.length === 1 ? args[0] : args; }}"
# Log out is a form POST in this tab (a GET would let any page sign the user out); relative, so it
# stays under a path prefix; the server answers with the sign-in page
LOG_OUT = """
() => {
  const form = document.createElement("form");
  form.method = "post";
  form.action = "logout";
  document.body.appendChild(form);
  form.submit();
}
"""
# the address bar keeps the open chat (?c=<id>): a reload or a shared link reopens it
SET_URL = """
(cid) => {
  const url = new URL(window.location.href);
  if (cid) url.searchParams.set("c", cid); else url.searchParams.delete("c");
  if (url.href !== window.location.href) window.history.replaceState(window.history.state, "", url);
}
"""
# the chat named at load, taken out of the address bar: opening it puts it back (SET_URL), a chat
# not found leaves the address without it
READ_URL = """
() => {
  const url = new URL(window.location.href);
  const cid = url.searchParams.get("c") || "";
  url.searchParams.delete("c");
  if (cid) window.history.replaceState(window.history.state, "", url);
  return cid;
}
"""


def page_js() -> str:
    """The page's scripts, each run once on load."""
    return "() => {" + "".join(f"({js.strip()})();" for js in (JS, JS_VERSIONS, JS_MOBILE)) + "}"


def theme():
    return gr.themes.Soft(primary_hue="indigo", neutral_hue="slate")


def build_ui(
    service: ChatService | ModelChats,
    *,
    auth_enabled: bool = False,
    local_user: str = LOCAL_USER,
    title: str = "chatengine",
    max_n: int = 4,
    admins: Container[str] = frozenset(),
    default_max_tokens: int | None = 2048,
    accounts: UserDirectory | None = None,
    catalog: PersonaCatalog | None = None,
) -> gr.Blocks:
    """With auth on, only `admins` see the Engine tab (it shows every user's load on the server).
    default_max_tokens: the Max tokens setting a page starts with (as the API's --default-max-tokens;
    None: up to the context), held within the model's context, which is also the slider's end.
    With several models, a model picker per chat; the slider ends at the largest model's limit."""
    service = ModelChats.of(service)
    limit = max(service.for_model(m).engine.max_tokens_limit for m in service.ids)
    max_tokens = (min(default_max_tokens or limit, limit), limit)
    with gr.Blocks(title=title, analytics_enabled=False, fill_width=True) as demo:
        c = build_components(
            service.personas,
            service.default_persona,
            title,
            max_n,
            show_engine=not auth_enabled,
            max_tokens=max_tokens,
            models=service.ids,
        )
        ui = ChatUI(service, c, auth_enabled=auth_enabled, local_user=local_user, admins=admins)
        demo.load(
            ui.on_load, None, [c.conv_list, c.who_md, c.logout_btn, c.engine_tab], api_visibility="private", queue=False
        ).then(ui.open_from_url, [c.url_cid], _open_outputs(c), js=READ_URL, api_visibility="private", **ENGINE)
        demo.unload(ui.on_unload)
        _wire_sidebar(ui, c)
        _wire_turns(ui, c)
        _wire_alternatives(ui, c)
        _wire_engine_tab(ui, c)
        if accounts is not None and catalog is not None:  # the Admin tab and the New persona form
            build_admin(ui, c, accounts, catalog, demo)
    demo.queue(default_concurrency_limit=None, max_size=512)
    return demo


def _new_chat_outputs(c: Components) -> list:
    # rename_box stays where it was (the menu fills it now): API clients read outputs by position
    return [c.cid, *c.view, c.conv_list, c.persona, c.model, c.rename_box, c.header, c.send_btn, c.stop_btn] + [
        c.url_cid
    ]


def _open_outputs(c: Components) -> list:
    return [c.cid, *c.view, c.persona, c.model, c.rename_box, c.conv_list, c.header, c.send_btn, c.stop_btn] + [
        c.url_cid,
        *c.sampling,
    ]


def _wire_sidebar(ui: ChatUI, c: Components) -> None:
    c.new_btn.click(ui.new_chat, [c.persona], _new_chat_outputs(c), api_name="new_chat", queue=False, js=CLOSE_SIDEBAR)
    # queued: it follows a reply still being written; "multiple": another chat opens meanwhile
    c.conv_list.input(
        ui.open_conv,
        [c.conv_list],
        _open_outputs(c),
        api_name="open",
        trigger_mode="multiple",
        show_progress="hidden",
        js=CLOSE_SIDEBAR,
        **ENGINE,
    )
    # the address bar names the open chat, and the chat's menu follows it
    c.url_cid.change(None, [c.url_cid], None, js=SET_URL, queue=False)
    c.logout_btn.click(None, None, None, js=LOG_OUT, queue=False)
    c.url_cid.change(ui.chat_menu, [c.url_cid], c.menu_parts, **QUIET)
    c.search.change(
        ui.on_search, [c.search, c.cid], [c.conv_list], api_name="search", queue=False, show_progress="hidden"
    )
    c.persona.input(ui.on_persona, [c.persona], [c.persona, c.chatbot], api_visibility="private", queue=False)
    _wire_menu(ui, c)


def _toggle(shown: bool) -> tuple:
    """The menu button opens the menu, or closes it when open."""
    return not shown, gr.update(visible=not shown)


def _wire_menu(ui: ChatUI, c: Components) -> None:
    c.menu_btn.click(_toggle, [c.menu_open], [c.menu_open, c.menu], **QUIET)
    c.rename_btn.click(ui.rename, [c.cid, c.rename_box], [c.conv_list], api_name="rename", queue=False)
    c.rename_box.submit(ui.rename, [c.cid, c.rename_box], [c.conv_list], api_visibility="private", queue=False)
    c.pin_btn.click(ui.toggle_pin, [c.cid], [c.conv_list, c.pin_btn], api_name="pin", queue=False)
    c.delete_btn.click(
        lambda cid: gr.update(visible=bool(cid)), [c.cid], [c.confirm_row], api_visibility="private", queue=False
    )
    c.cancel_btn.click(lambda: gr.update(visible=False), None, [c.confirm_row], api_visibility="private", queue=False)
    c.confirm_btn.click(
        ui.delete, [c.cid, c.persona], [*_new_chat_outputs(c), c.confirm_row], api_name="delete", queue=False
    )


def _generating(ui: ChatUI, c: Components, listen, fn, inputs, outputs, chained: bool = True, **kw) -> None:
    """Wire a generating handler to an event: the send button gives way to stop at once; the handler
    follows the reply while the tab shows its chat; then the buttons suit the chat on screen.
    chained=False for events whose data (RetryData, EditData) reaches only direct listeners, not
    .then() steps: the busy toggle is then a second listener of the same event."""
    buttons = [c.send_btn, c.stop_btn]
    first = listen(ui.busy, None, buttons, **QUIET)
    event = (first.then if chained else listen)(fn, inputs, outputs + buttons, show_progress="hidden", **ENGINE, **kw)
    event.then(ui.buttons_now, [c.cid], buttons, **QUIET)


def _wire_turns(ui: ChatUI, c: Components) -> None:
    send_in = [c.msg, c.cid, c.persona, *c.sampling, c.model]
    send_out = [c.msg, c.cid, *c.view, c.conv_list, c.persona, c.model, c.header, c.url_cid]
    _generating(ui, c, c.msg.submit, ui.send, send_in, send_out, api_name="send")
    _generating(ui, c, c.send_btn.click, ui.send, send_in, send_out, api_visibility="private")
    regen_out = [*c.view, c.conv_list]
    _generating(
        ui, c, c.regen_btn.click, ui.regenerate, [c.cid, c.focus, *c.sampling], regen_out, api_name="regenerate"
    )
    _generating(
        ui, c, c.continue_btn.click, ui.continue_reply, [c.cid, c.focus, *c.sampling], regen_out, api_name="continue"
    )
    _generating(
        ui,
        c,
        c.chatbot.retry,
        ui.retry,
        [c.cid, c.rows, *c.sampling],
        regen_out,
        chained=False,
        api_visibility="private",
    )
    _generating(
        ui, c, c.chatbot.edit, ui.edit, [c.cid, c.rows, *c.sampling], regen_out, chained=False, api_visibility="private"
    )
    c.stop_btn.click(ui.stop, [c.cid], [c.send_btn, c.stop_btn], api_name="stop", **ENGINE)
    for setting in c.sampling:  # by hand only (.input): opening a chat sets them without a save
        setting.input(ui.save_settings, [c.cid, *c.sampling], None, **QUIET)


def _wire_alternatives(ui: ChatUI, c: Components) -> None:
    c.ver_go.click(
        ui.step_version, [c.cid, c.ver_cmd], c.view, api_name="switch_version", queue=False, show_progress="hidden"
    )
    c.chatbot.select(ui.on_select, [c.cid, c.rows], [c.focus, *c.nav], **QUIET)


def _wire_engine_tab(ui: ChatUI, c: Components) -> None:
    picture = [c.kv_html, c.hit_plot, c.thr_plot]
    c.timer.tick(ui.engine_tick, [c.engine_model], picture, **QUIET)
    c.engine_tab.select(lambda: gr.Timer(active=True), None, [c.timer], api_visibility="private", queue=False).then(
        ui.engine_tick, [c.engine_model], picture, api_visibility="private", queue=False
    )
    c.engine_model.input(ui.engine_tick, [c.engine_model], picture, **QUIET)
    c.chat_tab.select(lambda: gr.Timer(active=False), None, [c.timer], api_visibility="private", queue=False)
