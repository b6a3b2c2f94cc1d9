"""The Admin tab (users and personas, admins only) and the chat tab's "New persona" form.

Every admin handler asks the database whether the caller is an admin before it does anything: the
tab is hidden from others, but a hidden tab's events can still be called through Gradio's queue,
so the check on the server is what protects them. Other users' private personas do not exist for
anyone but their owner, admins included.
"""

from __future__ import annotations

import asyncio
import html
from dataclasses import dataclass
from typing import Any

import gradio as gr

from chatengine.app.persona_catalog import PersonaCatalog
from chatengine.app.store import NotFound, StoreWriteError
from chatengine.app.ui.components import Components
from chatengine.app.ui.handlers import ChatUI
from chatengine.app.users import UserDirectory

PRIVATE: dict[str, Any] = dict(api_visibility="private", queue=False, show_progress="hidden")
USER_COLUMNS = ["user", "admin", "disabled", "can sign in", "API keys"]
NEW = ""  # the persona picker's "new persona" entry
REFUSALS = (ValueError, NotFound, PermissionError, StoreWriteError)


@dataclass
class AdminComponents:
    tab: gr.Tab
    users_table: gr.Dataframe
    new_name: gr.Textbox
    new_password: gr.Textbox
    new_admin: gr.Checkbox
    add_btn: gr.Button
    pick_user: gr.Dropdown
    disable_btn: gr.Button
    enable_btn: gr.Button
    reset_password: gr.Textbox
    reset_btn: gr.Button
    key_btn: gr.Button
    new_key: gr.Textbox
    pick_key: gr.Dropdown
    revoke_btn: gr.Button
    pick_persona: gr.Dropdown
    p_title: gr.Textbox
    p_description: gr.Textbox
    p_prompt: gr.Textbox
    p_public: gr.Checkbox
    p_save: gr.Button
    p_delete: gr.Button
    # the chat tab's form (every user)
    np_title: gr.Textbox
    np_description: gr.Textbox
    np_prompt: gr.Textbox
    np_create: gr.Button


def build_admin(ui: ChatUI, c: Components, accounts: UserDirectory, catalog: PersonaCatalog, demo: gr.Blocks) -> None:
    """Add the Admin tab beside the Engine tab and the form under the chat, and wire both."""
    with c.engine_tab.parent:  # the page's Tabs
        with gr.Tab("Admin", id="admin-tab", visible=False) as tab:
            parts = _users_section() | _personas_section()
    with c.chat_tab:
        form = _persona_form()
    a = AdminComponents(tab=tab, **parts, **form)
    handlers = AdminUI(ui, a, accounts, catalog)
    _wire(handlers, a, c, demo)


def _users_section() -> dict:
    gr.Markdown("### Users")
    p: dict[str, Any] = dict(
        users_table=gr.Dataframe(headers=USER_COLUMNS, interactive=False, elem_id="users-table", wrap=True)
    )
    with gr.Row():
        p["new_name"] = gr.Textbox(label="New user name", max_lines=1, elem_id="new-user-name")
        p["new_password"] = gr.Textbox(label="Password", type="password", max_lines=1, elem_id="new-user-password")
        p["new_admin"] = gr.Checkbox(label="Admin", elem_id="new-user-admin")
        p["add_btn"] = gr.Button("Add user", variant="primary", elem_id="add-user", scale=0)
    with gr.Row():
        p["pick_user"] = gr.Dropdown([], label="User", elem_id="pick-user", allow_custom_value=True)
        p["disable_btn"] = gr.Button("Disable", variant="stop", elem_id="disable-user", scale=0)
        p["enable_btn"] = gr.Button("Enable", elem_id="enable-user", scale=0)
    with gr.Row():
        p["reset_password"] = gr.Textbox(label="New password", type="password", max_lines=1, elem_id="reset-password")
        p["reset_btn"] = gr.Button("Reset password", elem_id="reset-btn", scale=0)
    with gr.Row():
        p["key_btn"] = gr.Button("Create API key", elem_id="create-key", scale=0)
        p["new_key"] = gr.Textbox(
            label="New API key (shown once: copy it now)", interactive=False, elem_id="new-key", buttons=["copy"]
        )
        p["pick_key"] = gr.Dropdown([], label="Key", elem_id="pick-key", allow_custom_value=True)
        p["revoke_btn"] = gr.Button("Revoke key", variant="stop", elem_id="revoke-key", scale=0)
    return p


def _persona_fields(prefix: str) -> dict:
    return dict(
        title=gr.Textbox(label="Title", max_lines=1, elem_id=f"{prefix}-title"),
        description=gr.Textbox(label="Description", max_lines=1, elem_id=f"{prefix}-description"),
        prompt=gr.Textbox(label="System prompt", lines=5, max_lines=20, elem_id=f"{prefix}-prompt"),
    )


def _personas_section() -> dict:
    gr.Markdown("### Personas")
    p: dict[str, Any] = dict(
        pick_persona=gr.Dropdown([("+ New persona", NEW)], value=NEW, label="Persona", elem_id="pick-persona")
    )
    fields = _persona_fields("persona")
    p.update(p_title=fields["title"], p_description=fields["description"], p_prompt=fields["prompt"])
    with gr.Row():
        p["p_public"] = gr.Checkbox(label="Public (every user may pick it)", value=True, elem_id="persona-public")
        p["p_save"] = gr.Button("Save persona", variant="primary", elem_id="persona-save", scale=0)
        p["p_delete"] = gr.Button("Delete persona", variant="stop", elem_id="persona-delete", scale=0)
    return p


def _persona_form() -> dict:
    with gr.Accordion("New persona (only you see it)", open=False, elem_id="new-persona"):
        fields = _persona_fields("np")
        create = gr.Button("Create persona", elem_id="np-create", size="sm")
    return dict(
        np_title=fields["title"], np_description=fields["description"], np_prompt=fields["prompt"], np_create=create
    )


def _wire(h: AdminUI, a: AdminComponents, c: Components, demo: gr.Blocks) -> None:
    users_out = [a.users_table, a.pick_user, a.pick_key]
    demo.load(h.on_load, None, [a.tab, c.persona, *users_out, a.pick_persona], **PRIVATE)
    a.add_btn.click(h.add_user, [a.new_name, a.new_password, a.new_admin], [*users_out, a.new_password], **PRIVATE)
    a.pick_user.input(h.pick_user, [a.pick_user], [a.pick_key, a.new_key], **PRIVATE)
    a.disable_btn.click(h.disable, [a.pick_user], users_out, **PRIVATE)
    a.enable_btn.click(h.enable, [a.pick_user], users_out, **PRIVATE)
    a.reset_btn.click(h.reset_password, [a.pick_user, a.reset_password], [a.reset_password], **PRIVATE)
    a.key_btn.click(h.create_key, [a.pick_user], [*users_out, a.new_key], **PRIVATE)
    a.revoke_btn.click(h.revoke_key, [a.pick_user, a.pick_key], users_out, **PRIVATE)
    editor = [a.p_title, a.p_description, a.p_prompt, a.p_public]
    a.pick_persona.input(h.pick_persona, [a.pick_persona], editor, **PRIVATE)
    # queued: saving a public persona warms its prefix in the engine
    a.p_save.click(
        h.save_persona, [a.pick_persona, *editor], [a.pick_persona, c.persona], api_visibility="private", queue=True
    )
    a.p_delete.click(h.delete_persona, [a.pick_persona], [a.pick_persona, c.persona, *editor], **PRIVATE)
    form = [a.np_title, a.np_description, a.np_prompt]
    a.np_create.click(h.create_private, form, [c.persona, *form], **PRIVATE)


class AdminUI:
    def __init__(self, ui: ChatUI, a: AdminComponents, accounts: UserDirectory, catalog: PersonaCatalog):
        self.ui, self.a, self.accounts, self.catalog = ui, a, accounts, catalog

    def admin(self, request: gr.Request) -> str:
        """The caller, if an admin; else refused (the tab is hidden, but its events can be called)."""
        user = self.ui.who(request)
        if not self.ui.is_admin(user):
            raise gr.Error("Only admins may do that.")
        return user

    # ---- page load ----------------------------------------------------------------------------
    def on_load(self, request: gr.Request) -> dict:
        user = self.ui.who(request)
        a, admin = self.a, self.ui.is_admin(user)
        out: dict = {a.tab: gr.update(visible=admin), self.ui.c.persona: self.persona_choices(user)}
        if admin:
            out.update(self.users_view(None))
            out[a.pick_persona] = self.admin_personas(user, NEW)
        return out

    def persona_choices(self, user: str, value: str | None = None) -> dict:
        """The chat's persona picker for `user`: public personas and their own."""
        visible = self.catalog.visible(user)
        choices = [(p.title, key) for key, p in visible.items()]
        if value is None or value not in visible:
            value = next(iter(visible), None)
        return gr.update(choices=choices, value=value)

    # ---- users --------------------------------------------------------------------------------
    def users_view(self, picked: str | None) -> dict:
        a, users = self.a, self.accounts.all_users()
        rows = [
            [u["name"], _yes(u["admin"]), _yes(u["disabled"]), _yes(u["can_sign_in"]), " ".join(u["keys"])]
            for u in users
        ]
        keys: list[str] = next((u["keys"] for u in users if u["name"] == picked), [])
        return {
            a.users_table: gr.update(value=rows),
            a.pick_user: gr.update(choices=[u["name"] for u in users], value=picked),
            a.pick_key: gr.update(choices=keys, value=keys[0] if keys else None),
        }

    def add_user(self, name, password, admin, request: gr.Request) -> dict:
        self.admin(request)
        if not self._do(self.accounts.add, name, password, admin=bool(admin)):
            return {self.a.new_password: gr.skip()}
        gr.Info(f"User {html.escape(name)} added.")
        return {**self.users_view(name), self.a.new_password: ""}

    def pick_user(self, name, request: gr.Request) -> dict:
        self.admin(request)
        view = self.users_view(name)
        return {self.a.pick_key: view[self.a.pick_key], self.a.new_key: ""}

    def disable(self, name, request: gr.Request) -> dict:
        if self.admin(request) == name:
            gr.Warning("You cannot disable yourself.")
            return self.users_view(name)
        if self._do(self.accounts.set_disabled, self._picked(name), True):
            gr.Info(f"{html.escape(name)} is disabled and signed out.")
        return self.users_view(name)

    def enable(self, name, request: gr.Request) -> dict:
        self.admin(request)
        self._do(self.accounts.set_disabled, self._picked(name), False)
        return self.users_view(name)

    def reset_password(self, name, password, request: gr.Request):
        self.admin(request)
        if not self._do(self.accounts.set_password, self._picked(name), password):
            return gr.skip()
        gr.Info(f"The password of {html.escape(name)} is changed.")
        return ""

    def create_key(self, name, request: gr.Request) -> dict:
        self.admin(request)
        try:
            key = self.accounts.create_key(self._picked(name))
        except REFUSALS as e:
            gr.Warning(_words(e))
            return {self.a.new_key: ""}
        return {**self.users_view(name), self.a.new_key: key}

    def revoke_key(self, name, key_id, request: gr.Request) -> dict:
        self.admin(request)
        if self._do(self.accounts.revoke_key, self._picked(name), key_id or ""):
            gr.Info(f"Key {html.escape(key_id)} revoked.")
        return self.users_view(name)

    @staticmethod
    def _picked(name) -> str:
        if not isinstance(name, str) or not name:
            raise ValueError("pick a user first")
        return name

    @staticmethod
    def _do(fn, *args, **kwargs) -> bool:
        """fn(...); a refusal becomes a warning in words (and False), the form keeps its input."""
        try:
            fn(*args, **kwargs)
        except REFUSALS as e:
            gr.Warning(_words(e))
            return False
        return True

    # ---- personas (admin) ---------------------------------------------------------------------
    def admin_personas(self, user: str, value: str) -> dict:
        rows = self.catalog.rows(user, admin=True)
        choices = [("+ New persona", NEW)] + [(f"{r['title']} ({_scope(r, user)})", r["key"]) for r in rows]
        return gr.update(choices=choices, value=value if any(v == value for _, v in choices) else NEW)

    def pick_persona(self, key, request: gr.Request) -> list:
        user = self.admin(request)
        row = next((r for r in self.catalog.rows(user, admin=True) if r["key"] == key), None)
        if row is None:
            return ["", "", "", True]
        return [row["title"], row["description"], row["system_prompt"], bool(row["public"])]

    async def save_persona(self, key, title, description, prompt, public, request: gr.Request):
        user = self.admin(request)
        try:
            key = await asyncio.to_thread(self._save, user, key, title, description, prompt, bool(public))
            if public:
                await self.catalog.warm(key)  # the first user of it finds its prefix computed
        except REFUSALS as e:
            gr.Warning(_words(e))
            return gr.skip(), gr.skip()
        gr.Info(f"Persona {html.escape(title.strip())} saved" + (", public and warmed." if public else " (private)."))
        return self.admin_personas(user, key), self.persona_choices(user, key)

    def _save(self, user, key, title, description, prompt, public: bool) -> str:
        if key:
            self.catalog.update(user, key, title, description, prompt, public=public, admin=True)
            return key
        return self.catalog.create(user, title, description, prompt, public=public, admin=True)

    def delete_persona(self, key, request: gr.Request) -> list:
        user = self.admin(request)
        if not key:
            gr.Warning("Pick a persona to delete.")
            return [gr.skip()] * 6
        if not self._do(self.catalog.delete, user, key, admin=True):
            return [gr.skip()] * 6
        gr.Info("Persona deleted.")
        return [self.admin_personas(user, NEW), self.persona_choices(user), "", "", "", True]

    # ---- the chat tab's form (any user) ---------------------------------------------------------
    def create_private(self, title, description, prompt, request: gr.Request) -> list:
        user = self.ui.who(request)
        try:
            key = self.catalog.create(user, title, description, prompt, public=False, admin=False)
        except REFUSALS as e:
            gr.Warning(_words(e))
            return [gr.skip()] * 4
        gr.Info(f"Persona {html.escape(title.strip())} created: only you see it.")
        return [self.persona_choices(user, key), "", "", ""]


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def _scope(row: dict, user: str) -> str:
    if row["public"]:
        return "public"
    return "private" if row["owner"] == user else "private, of a file"


def _words(e: Exception) -> str:
    """A refusal in words: NotFound's repr quotes would read oddly."""
    return html.escape(str(e.args[0]) if e.args else "that did not work")
