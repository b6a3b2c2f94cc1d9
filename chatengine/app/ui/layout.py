"""The browser chat UI (Gradio 6 Blocks) on top of ChatService.

Layout: a sidebar (new chat, search, the user's conversations, rename / delete), a "Chat" tab
(persona picker for a new chat, the transcript, ◀ k/N ▶ alternatives of the selected message,
regenerate, the input with Send / Stop, sampling settings) and an "Engine" tab (KV pages of the
device, CPU and disk tiers, hit rate and throughput over time).

Every handler takes the user from ``gr.Request`` (``request.username`` when login is on, one local
user otherwise) and passes it to ChatService, which checks ownership in SQL: a conversation id
of someone else behaves exactly like an id that does not exist. Conversation ids live in
server-side ``gr.State``; the values of components a client could set are checked the same way.

Streaming follows ui.md: async generators, no per-event concurrency limit (the engine batches
all users), UI updates throttled to ~80 ms. Message text is HTML-escaped outside code (and
Gradio sanitizes the rest), so HTML or script in a message shows as text and never runs.
"""
from __future__ import annotations

import asyncio
import html
import logging
import re
import time
from collections import Counter, deque

import gradio as gr

from chatengine.app.chat import ChatService, NotFound

log = logging.getLogger("chatengine.ui")

LOCAL_USER = "local"
THROTTLE_S = 0.08
ENGINE = dict(concurrency_limit=None, concurrency_id="engine")
HISTORY_POINTS = 600            # engine samples kept for the plots (1 per second: 10 minutes)

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
"""


def theme():
    return gr.themes.Soft(primary_hue="indigo", neutral_hue="slate")


# ---- text ---------------------------------------------------------------------------------------
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1", re.S)


def _segments(text: str):
    """Split markdown into (is_code, chunk) pieces: fenced blocks and inline code spans are code."""
    out, buf, fence = [], [], None
    for line in text.splitlines(keepends=True):
        m = _FENCE.match(line)
        if fence is None and m:
            out.append((False, "".join(buf)))
            buf, fence = [line], m.group(1)
        elif fence is not None:
            buf.append(line)
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
                out.append((True, "".join(buf)))
                buf, fence = [], None
        else:
            buf.append(line)
    out.append((fence is not None, "".join(buf)))
    pieces = []
    for is_code, chunk in out:
        if is_code or not chunk:
            pieces.append((is_code, chunk))
            continue
        pos = 0
        for m in _INLINE_CODE.finditer(chunk):
            pieces.append((False, chunk[pos:m.start()]))
            pieces.append((True, m.group(0)))
            pos = m.end()
        pieces.append((False, chunk[pos:]))
    return pieces


def escape_html(text: str) -> str:
    """Escape & and < outside code, so HTML in a message is shown as text (markdown and code
    blocks still render; code is escaped by the markdown renderer itself)."""
    return "".join(c if code else c.replace("&", "&amp;").replace("<", "&lt;") for code, c in _segments(text))


def unescape_html(text: str) -> str:
    """The inverse of escape_html (for the text of an edited message)."""
    return "".join(c if code else c.replace("&lt;", "<").replace("&amp;", "&") for code, c in _segments(text))


def _fmt_ms(ms) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def footer(m: dict, streaming: bool = False) -> str:
    """The stats line under a reply (HTML with fixed classes; every value is escaped)."""
    st = m.get("stats") or {}
    parts = []
    if m.get("n", 1) > 1:
        parts.append(f"<span class='alt'>{m['k']}/{m['n']}</span>")
    if st.get("tokens") is not None:
        parts.append(f"{st['tokens']} tokens")
    if st.get("ttft_ms") is not None:
        parts.append(f"TTFT {_fmt_ms(st['ttft_ms'])}")
    if st.get("tok_s") is not None:
        parts.append(f"{st['tok_s']:.1f} tok/s")
    if st.get("prompt_tokens") is not None:
        parts.append(f"{st.get('cached_tokens', 0)}/{st['prompt_tokens']} prompt tokens from cache")
    status = m.get("status")
    warn = None
    if status == "aborted":
        parts.append("stopped")
    elif status == "interrupted":
        warn = "interrupted (the server stopped)"
    elif status == "error":
        warn = "error: " + str(st.get("error") or "generation failed")
    elif st.get("finish_reason") == "length":
        parts.append("cut at max tokens")
    if streaming:
        parts = parts[:1] + ["generating…"] if m.get("n", 1) > 1 else ["generating…"]
    text = " · ".join(parts)
    if warn:
        text += (" · " if text else "") + f"<span class='msg-warn'>⚠ {html.escape(warn)}</span>"
    return f"<span class='msg-stats'>{text}</span>" if text else ""


def to_chat(view: list[dict], streaming_id: str | None = None) -> list[dict]:
    rows = []
    for m in view:
        if m["role"] == "user":
            rows.append({"role": "user", "content": escape_html(m["content"])})
            continue
        streaming = m["id"] == streaming_id
        body = escape_html(m["content"])
        if streaming:
            body += " ▍"
        elif not body.strip():
            body = "*(no text)*" if m.get("status") != "aborted" else "*(stopped before the first token)*"
        foot = footer(m, streaming)
        rows.append({"role": "assistant", "content": body + ("\n\n" + foot if foot else "")})
    return rows


def default_focus(view: list[dict], focus: str | None) -> str | None:
    ids = [m["id"] for m in view]
    if focus in ids:
        return focus
    for m in reversed(view):
        if m["role"] == "assistant":
            return m["id"]
    return ids[-1] if ids else None


def nav_state(view: list[dict], focus: str | None):
    """(label markdown, prev interactive, next interactive) for the selected message."""
    m = next((m for m in view if m["id"] == focus), None)
    if m is None:
        return "", False, False
    pos = [x["id"] for x in view if x["role"] == m["role"]].index(m["id"]) + 1
    last = m["id"] == view[-1]["id"] or (m["role"] == "assistant" and
                                          m["id"] == next(x["id"] for x in reversed(view) if x["role"] == "assistant"))
    if m["role"] == "assistant":
        what = "Last reply" if last else f"Reply {pos}"
        kind = "alternative"
    else:
        what = f"Your message {pos}"
        kind = "version"
    label = f"{what} · {kind} **{m['k']} / {m['n']}**" if m["n"] > 1 else f"{what} · {kind} 1 / 1"
    if len(view) > 2:
        label += " <span style='opacity:.55'>· click a message to select it</span>"
    return label, m["k"] > 1, m["k"] < m["n"]


# ---- engine view --------------------------------------------------------------------------------
def kv_picture(stats: dict, max_cells: int = 768) -> str:
    """A waffle picture of the device KV pool (each cell = one or more pages) and tier counts."""
    total = int(stats.get("kv_blocks_total") or 0)
    used = int(stats.get("kv_blocks_used") or 0)
    shared = min(int(stats.get("kv_blocks_shared") or 0), used)
    cached = int(stats.get("kv_blocks_cached") or 0)
    free = max(int(stats.get("kv_blocks_free", total - used)) - cached, 0)
    per = max(1, -(-total // max_cells))
    cells = []
    for cls, count in (("kv-shared", shared), ("kv-used", used - shared), ("kv-cached", cached), ("kv-free", free)):
        cells += [cls] * (-(-count // per) if count else 0)
    cells = cells[: -(-total // per)] if total else []
    grid = "".join(f"<div class='kv-cell {c}'></div>" for c in cells)
    bs = stats.get("block_size", 16)

    def legend(cls, label, n):
        return f"<span><span class='kv-cell {cls}'></span>{label}: <b>{n}</b></span>"

    hit = stats.get("prefix_cache_hit_rate")
    tiers = [
        ("Device pages", f"{used + cached}/{total}", f"{used} in use · {cached} cached · {free} free"),
        ("Shared pages", shared, "used by more than one sequence (personas, forks)"),
        ("CPU tier", stats.get("cpu_blocks_used", 0), "pages offloaded to CPU memory"),
        ("Disk tier", stats.get("disk_blocks", 0), "pages persisted on disk"),
        ("Prefix-cache hit rate", f"{100 * hit:.1f}%" if hit is not None else "–", "of prompt tokens since start"),
        ("Requests", f"{stats.get('num_running', 0)} running", f"{stats.get('num_waiting', 0)} waiting · "
                                                              f"{stats.get('num_preemptions', 0)} preempted"),
        ("Generated tokens", stats.get("num_generated_tokens", 0), f"{stats.get('model', '')} on {stats.get('device', '?')}"),
    ]
    tier_html = "".join(f"<div class='kv-tier'><span>{html.escape(str(a))}</span><b>{html.escape(str(b))}</b>"
                        f"<span>{html.escape(str(c))}</span></div>" for a, b, c in tiers)
    scale = f" (one cell = {per} pages)" if per > 1 else ""
    return (f"<div><div class='kv-legend'>{legend('kv-shared', 'shared', shared)}"
            f"{legend('kv-used', 'in use', used - shared)}{legend('kv-cached', 'cached (reusable)', cached)}"
            f"{legend('kv-free', 'free', free)}<span style='opacity:.7'>{total} device pages of {bs} tokens{scale}"
            f"</span></div><div class='kv-grid'>{grid}</div><div class='kv-tiers'>{tier_html}</div></div>")


class EngineMonitor:
    """Samples engine.stats() once a second (while the server runs) for the plots."""

    def __init__(self, engine, interval: float = 1.0):
        self.engine, self.interval = engine, interval
        self.samples: deque = deque(maxlen=HISTORY_POINTS)
        self.t0 = time.time()
        self._task: asyncio.Task | None = None
        self._prev = None

    def stats(self) -> dict:
        for _ in range(3):      # stats() reads engine structures that its thread may be changing
            try:
                return self.engine.stats()
            except RuntimeError:
                time.sleep(0.001)
        return {}

    def sample(self) -> dict:
        st = self.stats()
        now = time.time()
        point = {"t": now, "hit_rate": 100 * float(st.get("prefix_cache_hit_rate") or 0), "tok_s": 0.0,
                 "window_hit": None}
        if self._prev is not None:
            pt, pst = self._prev
            dt = max(now - pt, 1e-6)
            point["tok_s"] = max(0, st.get("num_generated_tokens", 0) - pst.get("num_generated_tokens", 0)) / dt
            dq = st.get("prefix_cache_queried_tokens", 0) - pst.get("prefix_cache_queried_tokens", 0)
            if dq > 0:
                point["window_hit"] = 100 * (st.get("prefix_cache_hit_tokens", 0) - pst.get("prefix_cache_hit_tokens", 0)) / dq
        self._prev = (now, st)
        self.samples.append(point)
        return st

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._run())
            except RuntimeError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:       # never let the sampler die on a transient error
                log.exception("engine stats sample failed")
            await asyncio.sleep(self.interval)

    def frames(self):
        import pandas as pd
        pts = list(self.samples)
        now = time.time()
        hit = [{"t": round(p["t"] - now, 1), "value": p["hit_rate"], "series": "since start"} for p in pts]
        hit += [{"t": round(p["t"] - now, 1), "value": p["window_hit"], "series": "per second"}
                for p in pts if p["window_hit"] is not None]
        thr = [{"t": round(p["t"] - now, 1), "value": round(p["tok_s"], 2)} for p in pts]
        hit_df = pd.DataFrame(hit, columns=["t", "value", "series"]).astype({"t": float, "value": float})
        thr_df = pd.DataFrame(thr, columns=["t", "value"]).astype({"t": float, "value": float})
        return hit_df, thr_df


# ---- the app ------------------------------------------------------------------------------------
def build_ui(service: ChatService, *, auth_enabled: bool = False, local_user: str = LOCAL_USER,
             title: str = "chatengine", max_n: int = 4) -> gr.Blocks:
    personas = service.personas
    persona_choices = [(p.title, name) for name, p in personas.items()]
    default_persona = service.default_persona
    monitor = EngineMonitor(service.engine)
    viewing: dict[str, str | None] = {}     # session -> the conversation its tab shows
    painting: Counter = Counter()           # (session, conversation) -> replies streaming into it

    def who(request: gr.Request | None) -> str:
        name = getattr(request, "username", None) if request is not None else None
        if name:
            return str(name)
        if auth_enabled:
            raise gr.Error("Please log in.")
        return local_user

    def persona_placeholder(name: str | None) -> str:
        p = personas.get(name or "")
        if p is None:
            return "### Start a conversation\nType a message below."
        return (f"<div style='text-align:center'><h2>{html.escape(p.title)}</h2>"
                f"<p style='opacity:.75'>{html.escape(p.description)}</p>"
                "<p style='opacity:.55;font-size:.9em'>Pick a persona above, then type a message below.</p></div>")

    def persona_header(name: str | None):
        """The one-line persona header of an open conversation (the picker is for new chats)."""
        p = personas.get(name or "")
        if p is None:
            return gr.update(value="", visible=False)
        return gr.update(value=f"**{html.escape(p.title)}** <span style='opacity:.65'>· "
                               f"{html.escape(p.description)}</span>", visible=True)

    def conv_choices(user: str, query: str | None = None) -> list[tuple[str, str]]:
        return [(c["title"], c["id"]) for c in service.list_conversations(user, (query or "").strip() or None)]

    def settings_of(temperature, top_p, max_tokens, seed, n) -> dict:
        seed = None if seed is None or seed == "" or float(seed) < 0 else int(seed)
        return dict(temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_tokens),
                    seed=seed, n=int(n))

    def nav_updates(view, focus):
        label, can_prev, can_next = nav_state(view, focus)
        has = focus is not None
        return (gr.update(value=label), gr.update(interactive=can_prev), gr.update(interactive=can_next),
                gr.update(interactive=has))

    def render(user, cid, focus=None):
        """(chatbot, rows, focus, label, prev, next, regen) for conversation ``cid``."""
        view = service.view(user, cid) if cid else []
        focus = default_focus(view, focus)
        return (to_chat(view), [m["id"] for m in view], focus, *nav_updates(view, focus))

    with gr.Blocks(title=title, analytics_enabled=False, fill_width=True) as demo:
        cid = gr.State(None)
        rows = gr.State([])
        focus = gr.State(None)

        with gr.Sidebar(width=300, elem_id="sidebar"):
            gr.Markdown(f"### {html.escape(title)}")
            who_md = gr.Markdown("", elem_id="who")
            new_btn = gr.Button("+ New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search chats…", show_label=False, elem_id="search",
                                container=False)
            conv_list = gr.Radio(choices=[], value=None, show_label=False, elem_id="conv-list",
                                 container=False)
            with gr.Accordion("Manage this chat", open=False, elem_id="manage"):
                rename_box = gr.Textbox(label="Title", max_lines=1, elem_id="rename-box")
                with gr.Row():
                    rename_btn = gr.Button("Rename", size="sm", elem_id="rename")
                    delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
                with gr.Column(visible=False) as confirm_row:
                    gr.Markdown("**Delete this chat for good?**")
                    with gr.Row():
                        confirm_btn = gr.Button("Yes, delete", size="sm", variant="stop", elem_id="confirm-delete")
                        cancel_btn = gr.Button("Cancel", size="sm")

        with gr.Tabs():
            with gr.Tab("Chat", id="chat-tab") as chat_tab:
                persona = gr.Dropdown(persona_choices, value=default_persona, label="Persona for this new chat",
                                      info=personas[default_persona].description if default_persona else None,
                                      elem_id="persona", interactive=True)
                header = gr.Markdown("", elem_id="conv-header", visible=False)
                chatbot = gr.Chatbot(elem_id="chat", height="calc(100vh - 330px)", min_height=320, show_label=False,
                                     editable="user", buttons=["copy", "copy_all"], autoscroll=True,
                                     placeholder=persona_placeholder(default_persona),
                                     feedback_options=None, layout="bubble", sanitize_html=True,
                                     group_consecutive_messages=False)
                with gr.Row(elem_id="nav-row"):
                    prev_btn = gr.Button("◀", size="sm", interactive=False, elem_id="alt-prev", scale=0,
                                         min_width=44)
                    next_btn = gr.Button("▶", size="sm", interactive=False, elem_id="alt-next", scale=0,
                                         min_width=44)
                    alt_label = gr.Markdown("", elem_id="alt-label")
                    regen_btn = gr.Button("↻ Regenerate", size="sm", interactive=False, elem_id="regenerate",
                                          scale=0, min_width=130)
                with gr.Row(elem_id="input-row"):
                    msg = gr.Textbox(placeholder="Message… (Enter to send, Shift+Enter for a new line)",
                                     show_label=False, lines=1, max_lines=8, scale=8, elem_id="msg",
                                     container=False, autofocus=True)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                    stop_btn = gr.Button("■ Stop", variant="stop", scale=1, visible=False, elem_id="stop")
                with gr.Accordion("Generation settings", open=False, elem_id="settings"):
                    with gr.Row():
                        temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature",
                                                info="0 = greedy", elem_id="temperature")
                        top_p = gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top-p", elem_id="top-p")
                        max_tokens = gr.Slider(1, 2048, value=256, step=1, label="Max tokens",
                                               elem_id="max-tokens")
                    with gr.Row():
                        seed = gr.Number(value=-1, precision=0, label="Seed", info="-1 = random",
                                         elem_id="seed")
                        n_alt = gr.Slider(1, max_n, value=1, step=1, label="Alternatives (n)",
                                          info="parallel samples in one engine request", elem_id="n")
            with gr.Tab("Engine", id="engine-tab") as engine_tab:
                gr.Markdown("Live view of the engine's KV cache: pages on the device (in use by running "
                            "requests, shared between sequences, cached for reuse, free), and pages moved "
                            "to the CPU and disk tiers. Updated every second.")
                kv_html = gr.HTML(elem_id="kv-view")
                with gr.Row():
                    hit_plot = gr.LinePlot(x="t", y="value", color="series", title="Prefix-cache hit rate (%)",
                                           x_title="seconds ago", y_title="hit rate %", y_lim=[0, 100],
                                           height=260, elem_id="hit-plot", show_label=False)
                    thr_plot = gr.LinePlot(x="t", y="value", title="Throughput (generated tokens/s)",
                                           x_title="seconds ago", y_title="tokens/s", height=260,
                                           elem_id="thr-plot", show_label=False)
                timer = gr.Timer(1.0, active=False)

        sampling = [temperature, top_p, max_tokens, seed, n_alt]
        nav_out = [alt_label, prev_btn, next_btn, regen_btn]
        view_out = [chatbot, rows, focus, *nav_out]

        # ---- page load / sidebar ----------------------------------------------------------------
        async def on_load(request: gr.Request):      # async: runs on the server loop (the sampler task)
            user = who(request)
            monitor.ensure_running()
            name = f"Signed in as **{html.escape(user)}** · [Log out](/logout)" if auth_enabled else ""
            return gr.update(choices=conv_choices(user), value=None), name

        demo.load(on_load, None, [conv_list, who_md], api_visibility="private", queue=False)

        def on_unload(request: gr.Request):
            viewing.pop(request.session_hash, None)

        demo.unload(on_unload)

        def new_chat(persona_name, request: gr.Request):
            who(request)
            viewing[request.session_hash] = None
            name = persona_name if persona_name in personas else default_persona
            p = personas.get(name)
            return (None, gr.update(value=[], placeholder=persona_placeholder(name)), [], None,
                    gr.update(value=""), gr.update(interactive=False), gr.update(interactive=False),
                    gr.update(interactive=False), gr.update(value=None),
                    gr.update(visible=True, value=name, info=p.description if p else None), "",
                    gr.update(visible=False))

        new_chat_out = [cid, chatbot, rows, focus, *nav_out, conv_list, persona, rename_box, header]
        new_btn.click(new_chat, [persona], new_chat_out, api_name="new_chat", queue=False)

        def open_conv(conv_id, request: gr.Request):
            user = who(request)
            if not conv_id:
                return (gr.skip(),) * 12
            try:
                conv = service.get_conversation(user, conv_id)
                out = render(user, conv_id)
            except NotFound:
                gr.Warning("That conversation does not exist.")
                return (None, [], [], None, "", gr.update(interactive=False), gr.update(interactive=False),
                        gr.update(interactive=False), gr.skip(), "",
                        gr.update(choices=conv_choices(user), value=None), gr.skip())
            viewing[request.session_hash] = conv_id
            p = conv["persona"]
            return (conv_id, *out, gr.update(visible=False), conv["title"], gr.skip(), persona_header(p))

        conv_list.input(open_conv, [conv_list], [cid, *view_out, persona, rename_box, conv_list, header],
                        api_name="open", queue=False)

        def fill_title(conv_id, request: gr.Request):
            user = who(request)
            if not conv_id:
                return ""
            try:
                return service.get_conversation(user, conv_id)["title"]
            except NotFound:
                return ""

        conv_list.change(fill_title, [conv_list], [rename_box], api_visibility="private", queue=False,
                         show_progress="hidden")

        def on_search(query, current, request: gr.Request):
            user = who(request)
            return gr.update(choices=conv_choices(user, query), value=current)

        search.change(on_search, [search, cid], [conv_list], api_name="search", queue=False,
                      show_progress="hidden")

        def on_persona(name):
            p = personas.get(name)
            return gr.update(info=p.description if p else None), gr.update(placeholder=persona_placeholder(name))

        persona.input(on_persona, [persona], [persona, chatbot], api_visibility="private", queue=False)

        def rename(conv_id, new_title, request: gr.Request):
            user = who(request)
            if not conv_id:
                gr.Warning("Open a chat first.")
                return gr.skip()
            try:
                service.rename_conversation(user, conv_id, new_title)
            except NotFound:
                gr.Warning("That conversation does not exist.")
            except ValueError as e:
                gr.Warning(str(e))
            return gr.update(choices=conv_choices(user), value=conv_id)

        rename_btn.click(rename, [cid, rename_box], [conv_list], api_name="rename", queue=False)
        rename_box.submit(rename, [cid, rename_box], [conv_list], api_visibility="private", queue=False)

        delete_btn.click(lambda c: gr.update(visible=bool(c)), [cid], [confirm_row], api_visibility="private",
                         queue=False)
        cancel_btn.click(lambda: gr.update(visible=False), None, [confirm_row], api_visibility="private",
                         queue=False)

        def delete(conv_id, persona_name, request: gr.Request):
            user = who(request)
            if conv_id:
                try:
                    service.delete_conversation(user, conv_id)
                except NotFound:
                    gr.Warning("That conversation does not exist.")
            out = list(new_chat(persona_name, request))
            out[8] = gr.update(choices=conv_choices(user), value=None)
            return (*out, gr.update(visible=False))

        confirm_btn.click(delete, [cid, persona], [*new_chat_out, confirm_row], api_name="delete", queue=False)

        # ---- streaming turns --------------------------------------------------------------------
        async def stream(user: str, conv_id: str, gen, session: str):
            """Drive a ChatService generator; yield UI updates, throttled (the last one is the
            stored state: statuses, stats, k/N). While the tab shows another conversation, the
            reply goes on (and is saved) without touching the screen."""
            last = 0.0
            final = None
            view = None
            painting[session, conv_id] += 1
            try:
                async for up in gen:
                    final = up
                    if view is None:
                        view = service.view(user, conv_id)
                    now = time.monotonic()
                    if up.finished or now - last < THROTTLE_S or viewing.get(session, conv_id) != conv_id:
                        continue
                    last = now
                    shown = up.message_ids[0]
                    for m in view:
                        if m["id"] == shown:
                            m["content"] = up.texts[0]
                            m["stats"] = up.stats[0] if up.stats else {}
                    chat = to_chat(view, streaming_id=shown)
                    label = (f"Generating {len(up.message_ids)} alternatives…" if len(up.message_ids) > 1
                             else "Generating…")
                    upd = [chat, [m["id"] for m in view], shown, label, gr.update(interactive=False),
                           gr.update(interactive=False), gr.update(interactive=False)]
                    yield upd, gr.skip()
            finally:
                await gen.aclose()
                painting[session, conv_id] -= 1
                if not painting[session, conv_id]:
                    del painting[session, conv_id]
            if final is not None and final.status == "error":
                gr.Warning(final.error or "generation failed")
            if viewing.get(session, conv_id) != conv_id:
                yield [gr.skip()] * 7, gr.update(choices=conv_choices(user), value=viewing.get(session))
                return
            focus_id = final.message_ids[0] if final is not None else None
            out = render(user, conv_id, focus_id)
            yield list(out), gr.update(choices=conv_choices(user), value=conv_id)

        def start_view(user, conv_id):
            """Show the new user message at once, with an empty reply bubble."""
            view = service.view(user, conv_id)
            chat = to_chat(view) + [{"role": "assistant", "content": "▍"}]
            return [chat, [m["id"] for m in view] + [None], None, "Waiting for the engine…",
                    gr.update(interactive=False), gr.update(interactive=False), gr.update(interactive=False)]

        async def send(text, conv_id, persona_name, temperature, top_p, max_tokens, seed, n,
                       request: gr.Request):
            user = who(request)
            if not isinstance(text, str) or not text.strip():
                yield (gr.skip(),) * 12
                return
            is_new = conv_id is None
            try:
                settings = settings_of(temperature, top_p, max_tokens, seed, n)
                if is_new:
                    conv_id = service.new_conversation(user, persona_name or default_persona)
                try:
                    gen = service.send(user, conv_id, text, settings)
                except ValueError:
                    if is_new:               # leave no empty chat behind
                        service.delete_conversation(user, conv_id)
                    raise
            except NotFound:
                gr.Warning("That conversation does not exist; start a new chat.")
                yield (gr.skip(),) * 12
                return
            except ValueError as e:
                gr.Warning(str(e))
                yield (gr.skip(),) * 12
                return
            viewing[request.session_hash] = conv_id
            conv = service.get_conversation(user, conv_id)
            yield ("", conv_id, *start_view(user, conv_id), gr.update(choices=conv_choices(user), value=conv_id),
                   gr.update(visible=False), persona_header(conv["persona"]))
            async for upd, head in stream(user, conv_id, gen, request.session_hash):
                yield (gr.skip(), gr.skip(), *upd, head, gr.skip(), gr.skip())

        send_out = [msg, cid, *view_out, conv_list, persona, header]

        def busy():
            return gr.update(visible=False), gr.update(visible=True)

        def idle():
            return gr.update(visible=True), gr.update(visible=False)

        def generating(listen, fn, inputs, outputs, chained: bool = True, **kw):
            """Wire a generating handler to an event: the send button gives way to stop while it runs.
            chained=False for events whose data (RetryData, EditData) reaches only direct listeners,
            not .then() steps: the busy toggle is then a second listener of the same event."""
            toggle = dict(queue=False, api_visibility="private", show_progress="hidden")
            first = listen(busy, None, [send_btn, stop_btn], **toggle)
            event = (first.then if chained else listen)(fn, inputs, outputs, show_progress="hidden", **ENGINE, **kw)
            event.then(idle, None, [send_btn, stop_btn], **toggle)

        send_in = [msg, cid, persona, *sampling]
        generating(msg.submit, send, send_in, send_out, api_name="send")
        generating(send_btn.click, send, send_in, send_out, api_visibility="private")

        async def regenerate(conv_id, msg_id, temperature, top_p, max_tokens, seed, n, request: gr.Request):
            user = who(request)
            if not conv_id:
                yield (gr.skip(),) * 8
                return
            try:
                gen = service.regenerate(user, conv_id, msg_id, settings_of(temperature, top_p, max_tokens, seed, n))
            except NotFound:
                gr.Warning("That message does not exist.")
                yield (gr.skip(),) * 8
                return
            except ValueError as e:
                gr.Warning(str(e))
                yield (gr.skip(),) * 8
                return
            async for upd, head in stream(user, conv_id, gen, request.session_hash):
                yield (*upd, head)

        regen_out = [*view_out, conv_list]
        generating(regen_btn.click, regenerate, [cid, focus, *sampling], regen_out, api_name="regenerate")

        async def retry(conv_id, row_ids, temperature, top_p, max_tokens, seed, n, data: gr.RetryData,
                        request: gr.Request):
            idx = data.index if isinstance(data.index, int) else data.index[0]
            msg_id = row_ids[idx] if 0 <= idx < len(row_ids or []) else None
            async for out in regenerate(conv_id, msg_id, temperature, top_p, max_tokens, seed, n, request):
                yield out

        generating(chatbot.retry, retry, [cid, rows, *sampling], regen_out, chained=False, api_visibility="private")

        async def edit(conv_id, row_ids, temperature, top_p, max_tokens, seed, n, data: gr.EditData,
                       request: gr.Request):
            user = who(request)
            idx = data.index if isinstance(data.index, int) else data.index[0]
            msg_id = row_ids[idx] if conv_id and 0 <= idx < len(row_ids or []) else None
            value = data.value
            if isinstance(value, list):      # normalized content parts
                value = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in value)
            text = unescape_html(str(value or ""))
            try:
                if msg_id is None:
                    raise NotFound("no such message")
                gen = service.edit(user, conv_id, msg_id, text, settings_of(temperature, top_p, max_tokens, seed, n))
            except (NotFound, ValueError) as e:
                gr.Warning(str(e) if isinstance(e, ValueError) else "That message does not exist.")
                out = render(user, conv_id) if conv_id else (gr.skip(),) * 7
                yield (*out, gr.skip())
                return
            yield (*start_view(user, conv_id), gr.skip())
            async for upd, head in stream(user, conv_id, gen, request.session_hash):
                yield (*upd, head)

        generating(chatbot.edit, edit, [cid, rows, *sampling], regen_out, chained=False, api_visibility="private")

        async def stop(conv_id, request: gr.Request):
            user = who(request)
            if conv_id:
                try:
                    await service.stop(user, conv_id)
                except NotFound:
                    pass
            return gr.update(visible=True), gr.update(visible=False)

        stop_btn.click(stop, [cid], [send_btn, stop_btn], api_name="stop", **ENGINE)

        # ---- alternatives -----------------------------------------------------------------------
        def switch(step):
            def fn(conv_id, focus_id, request: gr.Request):
                user = who(request)
                if not conv_id or not focus_id:
                    return (gr.skip(),) * 7
                if painting[request.session_hash, conv_id]:
                    gr.Warning("Wait for the reply to finish before switching versions.")
                    return (gr.skip(),) * 7
                try:
                    target = service.switch(user, conv_id, focus_id, step)
                    return render(user, conv_id, target)
                except NotFound:
                    gr.Warning("That message does not exist.")
                    return (gr.skip(),) * 7
            return fn

        prev_btn.click(switch(-1), [cid, focus], view_out, api_name="previous_alternative", queue=False,
                       show_progress="hidden")
        next_btn.click(switch(+1), [cid, focus], view_out, api_name="next_alternative", queue=False,
                       show_progress="hidden")

        def on_select(conv_id, row_ids, data: gr.SelectData, request: gr.Request):
            user = who(request)
            idx = data.index if isinstance(data.index, int) else data.index[0]
            if not conv_id or not (0 <= idx < len(row_ids or [])) or row_ids[idx] is None:
                return (gr.skip(),) * 5
            if painting[request.session_hash, conv_id]:        # the stream owns the view and nav
                return (gr.skip(),) * 5
            try:
                view = service.view(user, conv_id)
            except NotFound:
                return (gr.skip(),) * 5
            return (row_ids[idx], *nav_updates(view, row_ids[idx]))

        chatbot.select(on_select, [cid, rows], [focus, *nav_out], api_visibility="private", queue=False,
                       show_progress="hidden")

        # ---- engine tab -------------------------------------------------------------------------
        async def engine_tick():
            monitor.ensure_running()
            st = monitor.stats()
            hit_df, thr_df = monitor.frames()
            return kv_picture(st), hit_df, thr_df

        timer.tick(engine_tick, None, [kv_html, hit_plot, thr_plot], api_visibility="private",
                   show_progress="hidden", queue=False)
        engine_tab.select(lambda: gr.Timer(active=True), None, [timer], api_visibility="private",
                          queue=False).then(engine_tick, None, [kv_html, hit_plot, thr_plot],
                                            api_visibility="private", queue=False)
        chat_tab.select(lambda: gr.Timer(active=False), None, [timer], api_visibility="private", queue=False)

    demo.queue(default_concurrency_limit=None, max_size=512)
    return demo
