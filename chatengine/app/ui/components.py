"""Every Gradio component of the page, by name: built once inside a Blocks context.

Handlers return dicts keyed by these components (`{ui.chatbot: ..., ui.conv_list: ...}`), so what
a handler changes is named, and whatever it leaves out keeps its value.
"""

import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gradio as gr

from chatengine.app.ui.render import persona_placeholder


@dataclass
class Components:
    # per-tab server-side state
    cid: gr.State  # the conversation this tab shows (None: a new chat)
    rows: gr.State  # message id of each transcript row (None: a placeholder row)
    focus: gr.State  # the selected message (its ◀ k/N ▶)
    menu_open: gr.State  # whether this tab shows the chat's menu
    url_cid: gr.Textbox  # the open chat as the address bar has it (?c=<id>); hidden, set with cid
    # sidebar
    who_md: gr.Markdown
    logout_btn: gr.Button
    new_btn: gr.Button
    search: gr.Textbox
    conv_list: gr.Radio
    # chat tab: the open chat's menu
    chat_tab: gr.Tab
    menu_btn: gr.Button  # "⋯": opens the menu (shown while a chat is open)
    menu: gr.Column
    rename_box: gr.Textbox
    rename_btn: gr.Button
    pin_btn: gr.Button  # "Pin" or "Unpin"
    export_html: gr.HTML  # the two download links
    delete_btn: gr.Button
    confirm_row: gr.Column
    confirm_btn: gr.Button
    cancel_btn: gr.Button
    persona: gr.Dropdown
    header: gr.Markdown
    chatbot: gr.Chatbot
    ver_cmd: gr.Textbox  # "message id:step" from a click on an inline ‹ k/N › (hidden)
    ver_go: gr.Button  # pressed by the page script after it sets ver_cmd (hidden)
    alt_label: gr.Markdown
    regen_btn: gr.Button
    continue_btn: gr.Button
    msg: gr.Textbox
    send_btn: gr.Button
    stop_btn: gr.Button
    temperature: gr.Slider
    top_p: gr.Slider
    max_tokens: gr.Slider
    seed: gr.Number
    n_alt: gr.Slider
    # engine tab
    engine_tab: gr.Tab
    kv_html: gr.HTML
    hit_plot: gr.LinePlot
    thr_plot: gr.LinePlot
    timer: gr.Timer
    # several models served (hidden with one)
    model: gr.Dropdown  # the model of a new chat; an open chat's own, fixed
    engine_model: gr.Dropdown  # whose engine the Engine tab shows

    @property
    def sampling(self) -> list:
        return [self.temperature, self.top_p, self.max_tokens, self.seed, self.n_alt]

    @property
    def menu_parts(self) -> list:
        """What opening another chat sets in the menu."""
        return [
            self.menu_btn,
            self.menu,
            self.menu_open,
            self.rename_box,
            self.pin_btn,
            self.export_html,
            self.confirm_row,
        ]

    @property
    def nav(self) -> list:
        return [self.alt_label, self.regen_btn, self.continue_btn]

    @property
    def view(self) -> list:
        """What a render of the open conversation sets."""
        return [self.chatbot, self.rows, self.focus, *self.nav]


def build_components(
    personas: Mapping,
    default_persona: str | None,
    title: str,
    max_n: int,
    show_engine: bool = True,
    max_tokens: tuple[int, int] = (256, 2048),
    models: list[str] | tuple[str, ...] = (),
) -> Components:
    """Lay the page out (inside `with gr.Blocks()`); returns its components by name. max_tokens: the
    slider's (default, maximum); models: the served model ids, the default first (pickers shown when
    there are several)."""
    state: dict[str, Any] = dict(cid=gr.State(None), rows=gr.State([]), focus=gr.State(None), menu_open=gr.State(False))
    with gr.Sidebar(width=300, elem_id="sidebar"):
        sidebar = _sidebar(title)
    with gr.Tabs():
        with gr.Tab("Chat", id="chat-tab") as chat_tab:
            chat = _chat_menu() | _chat_tab(personas, default_persona, max_n, max_tokens, models)
        with gr.Tab("Engine", id="engine-tab", visible=show_engine) as engine_tab:
            engine = _engine_tab(models)
    return Components(**state, **sidebar, chat_tab=chat_tab, **chat, engine_tab=engine_tab, **engine)


def _sidebar(title: str) -> dict:
    gr.Markdown(f"### {html.escape(title)}")
    c: dict[str, Any] = dict(
        who_md=gr.Markdown("", elem_id="who"),
        # posts to /logout in this tab (layout.py's LOG_OUT): a link's GET is what any page can make
        logout_btn=gr.Button("Log out", size="sm", visible=False, elem_id="logout"),
        new_btn=gr.Button("+ New chat", variant="primary", elem_id="new-chat"),
        search=gr.Textbox(placeholder="Search chats…", show_label=False, elem_id="search", container=False),
        conv_list=gr.Radio(choices=[], value=None, show_label=False, elem_id="conv-list", container=False),
    )
    return c


def _chat_menu() -> dict:
    """The open chat's menu: rename, pin, export, delete (after a confirm)."""
    c: dict[str, Any] = dict(
        menu_btn=gr.Button("⋯ Chat", size="sm", visible=False, elem_id="chat-menu-btn", scale=0, min_width=90)
    )
    with gr.Column(visible=False, elem_id="chat-menu") as menu:
        with gr.Row(elem_id="rename-row"):
            c["rename_box"] = gr.Textbox(label="Title", max_lines=1, elem_id="rename-box", scale=4)
            c["rename_btn"] = gr.Button("Rename", size="sm", elem_id="rename", scale=1, min_width=80)
        with gr.Row():
            c["pin_btn"] = gr.Button("Pin", size="sm", elem_id="pin")
            c["delete_btn"] = gr.Button("Delete…", size="sm", variant="stop", elem_id="delete")
        c["export_html"] = gr.HTML("", elem_id="export")
        with gr.Column(visible=False, elem_id="confirm-row") as confirm_row:
            gr.Markdown("**Delete this chat for good?** Its messages cannot be brought back.")
            with gr.Row():
                c["confirm_btn"] = gr.Button("Yes, delete", size="sm", variant="stop", elem_id="confirm-delete")
                c["cancel_btn"] = gr.Button("Cancel", size="sm", elem_id="cancel-delete")
        c["confirm_row"] = confirm_row
    c["menu"] = menu
    return c


def model_choices(models) -> list[tuple[str, str]]:
    """(label, id) of each served model: the id's last part (a path's directory or file name, a repo
    id's name), or the whole id where two models would show one label."""
    labels = [m.rstrip("/").rsplit("/", 1)[-1] or m for m in models]
    if len(set(labels)) < len(labels):
        labels = list(models)
    return list(zip(labels, models))


def _model_picker(models, label: str, elem_id: str) -> gr.Dropdown:
    return gr.Dropdown(
        model_choices(models),
        value=models[0] if models else None,
        label=label,
        elem_id=elem_id,
        interactive=True,
        visible=len(models) > 1,
    )


def _chat_tab(personas: Mapping, default_persona: str | None, max_n: int, max_tokens: tuple[int, int], models) -> dict:
    first = personas.get(default_persona or "")
    with gr.Row(elem_id="new-chat-row"):
        c: dict[str, Any] = dict(
            persona=gr.Dropdown(
                [(p.title, name) for name, p in personas.items()],
                value=default_persona,
                label="Persona for this new chat",
                info=first.description if first else None,
                elem_id="persona",
                interactive=True,
            ),
            model=_model_picker(models, "Model for this new chat", "model"),
        )
    c.update(
        header=gr.Markdown("", elem_id="conv-header", visible=False),
        chatbot=gr.Chatbot(
            elem_id="chat",
            height="calc(100vh - 330px)",
            min_height=320,
            show_label=False,
            editable="user",
            buttons=["copy", "copy_all"],
            autoscroll=True,
            placeholder=persona_placeholder(first),
            feedback_options=None,
            layout="bubble",
            sanitize_html=True,
            group_consecutive_messages=False,
        ),
    )
    with gr.Row(elem_id="nav-row"):
        c["alt_label"] = gr.Markdown("", elem_id="alt-label")
        c["regen_btn"] = gr.Button(
            "↻ Regenerate", size="sm", interactive=False, elem_id="regenerate", scale=0, min_width=130
        )
        c["continue_btn"] = gr.Button(
            "Continue ▸", size="sm", interactive=False, elem_id="continue", scale=0, min_width=110
        )
    with gr.Row(elem_classes="hidden-cmd"):  # in the page (a script reaches them) but never shown
        c["url_cid"] = gr.Textbox("", elem_id="url-cid", show_label=False, container=False)
        c["ver_cmd"] = gr.Textbox(elem_id="ver-cmd", show_label=False, container=False)
        c["ver_go"] = gr.Button("switch version", elem_id="ver-go")
    with gr.Row(elem_id="input-row"):
        c["msg"] = gr.Textbox(
            placeholder="Message… (Enter to send, Shift+Enter for a new line)",
            show_label=False,
            lines=1,
            max_lines=8,
            scale=8,
            elem_id="msg",
            container=False,
            autofocus=True,
        )
        c["send_btn"] = gr.Button("Send", variant="primary", scale=1, elem_id="send")
        c["stop_btn"] = gr.Button("■ Stop", variant="stop", scale=1, visible=False, elem_id="stop")
    with gr.Accordion("Generation settings", open=False, elem_id="settings"):
        c.update(_settings(max_n, max_tokens))
    return c


def _settings(max_n: int, max_tokens: tuple[int, int]) -> dict:
    with gr.Row():
        c: dict[str, Any] = dict(
            temperature=gr.Slider(
                0, 2, value=0.7, step=0.05, label="Temperature", info="0 = greedy", elem_id="temperature"
            ),
            top_p=gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top-p", elem_id="top-p"),
            max_tokens=gr.Slider(
                1, max_tokens[1], value=max_tokens[0], step=1, label="Max tokens", elem_id="max-tokens"
            ),
        )
    with gr.Row():
        c["seed"] = gr.Number(value=-1, precision=0, label="Seed", info="-1 = random", elem_id="seed")
        c["n_alt"] = gr.Slider(
            1,
            max_n,
            value=1,
            step=1,
            label="Alternatives (n)",
            info="parallel samples in one engine request",
            elem_id="n",
        )
    return c


def _engine_tab(models) -> dict:
    gr.Markdown(
        "Live view of the engine's KV cache: pages on the device (in use by running requests, shared "
        "between sequences, cached for reuse, free), and pages moved to the CPU and disk tiers. "
        "Updated every second."
    )
    # each served model has its own engine and KV pool: the tab shows the one picked here
    c: dict[str, Any] = dict(engine_model=_model_picker(models, "Engine of the model", "engine-model"))
    c["kv_html"] = gr.HTML(elem_id="kv-view")
    with gr.Row():
        c["hit_plot"] = gr.LinePlot(
            x="t",
            y="value",
            color="series",
            title="Prefix-cache hit rate (%)",
            x_title="seconds ago",
            y_title="hit rate %",
            y_lim=[0, 100],
            height=260,
            elem_id="hit-plot",
            show_label=False,
        )
        c["thr_plot"] = gr.LinePlot(
            x="t",
            y="value",
            title="Throughput (generated tokens/s)",
            x_title="seconds ago",
            y_title="tokens/s",
            height=260,
            elem_id="thr-plot",
            show_label=False,
        )
    c["timer"] = gr.Timer(1.0, active=False)
    return c
