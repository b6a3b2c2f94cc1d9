"""ChatService: one chat turn, shared by the UI (and the HTTP API).

A conversation is a tree in the ChatStore. Its root is the persona's system message; user and
assistant turns alternate below it; siblings are alternatives (regenerate, edit, n samples).

Conversations are token ids: every message stores the exact ids of its own turn, so
the prompt of the next turn is the concatenation of the stored ids along the path plus the ids
of the new user turn, and a follow-up hits every cached KV block of its history. For ChatML
(SmolLM2, Qwen2) the pieces are

    system     <|im_start|>system\\n{persona prompt}<|im_end|>\\n
    user       <|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n   (+ generation prompt)
    assistant  {generated ids ...}<|im_end|>\\n          (the closing is added when missing)

and their concatenation is the model's own full template rendering. The pieces are derived
from the model's chat template by rendering marker texts (`TurnTemplate`), and checked once
against a full rendering; a template whose turns do not concatenate (or a path whose ids are
missing and cannot be re-derived) falls back to rendering the whole conversation's text.

Everything is scoped by the authenticated ``user``: the store checks ownership in SQL, and an id
of another user's conversation raises ``NotFound`` exactly like an id that does not exist.

    svc = ChatService(engine, store, personas)
    cid = svc.new_conversation(user, persona="assistant")
    gen = svc.send(user, cid, "Hello", settings)          # -> Generation (generation.py)
    async for update in gen: ...                          # ReplyUpdates (cumulative) to the end
    gen = svc.regenerate(user, cid, assistant_msg_id, settings)
    gen = svc.edit(user, cid, user_msg_id, "new text", settings)
    gen = svc.continue_reply(user, cid, cut_reply_id, settings)   # more of a reply cut at max tokens
    svc.attach(user, cid)              # the Generation running in cid, or None: follow it too
    await svc.stop(user, cid)          # abort; the partial reply is kept with status "aborted"
    svc.view(user, cid)                # the active branch with k/N of every message
    svc.switch(user, cid, msg_id, +1)  # show the next alternative of msg_id

Replies belong to the server, not to whoever asked: a Generation runs as a task of the server's
event loop and writes the reply to the store as it goes. Leaving it (a tab that reloads, closes or
opens another chat) does not stop it; only Stop, the reply's own end or the server's shutdown do.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from chatengine.app.generation import Generation
from chatengine.app.store import ChatStore, NotFound, StoreWriteError
from chatengine.sampling_params import SamplingParams

__all__ = ["ChatService", "ChatSettings", "ReplyUpdate", "TurnTemplate", "NotFound"]

log = logging.getLogger("chatengine.chat")

DEFAULT_TITLE = "New chat"
TITLE_CHARS = 48
SAVE_EVERY_S = 1.0  # partial replies are written to the store this often while streaming
CLAIM_LAPSE_S = 60.0  # a turn claimed but never streamed frees its conversation after this
# replies one user may have being written at once, across conversations (of one model): more would
# be one person's share of the engine taken many times over (the scheduler is fair per request)
MAX_REPLIES_PER_USER = 4


@dataclass
class ChatSettings:
    """Sampling settings of one turn (the UI's settings panel)."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int | None = None
    n: int = 1

    @classmethod
    def from_any(cls, value) -> ChatSettings:
        if value is None:
            return cls()
        if isinstance(value, ChatSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"settings must be a dict, got {type(value).__name__}")
        known = {k: value[k] for k in ("temperature", "top_p", "max_tokens", "seed", "n") if k in value}
        s = cls(**known)
        # UI sliders deliver floats; accept integral floats for the integer fields
        for name in ("max_tokens", "n"):
            v = getattr(s, name)
            if isinstance(v, float) and v.is_integer():
                setattr(s, name, int(v))
        if isinstance(s.seed, float) and s.seed.is_integer():
            s.seed = int(s.seed)
        if s.seed is not None and s.seed < 0:  # a negative seed (the UI's -1) means random
            s.seed = None
        return s


@dataclass
class ReplyUpdate:
    """A cumulative snapshot of a reply being generated (all n alternatives)."""

    conversation_id: str
    user_message_id: str
    message_ids: list[str]
    texts: list[str]
    num_tokens: list[int]
    finish_reasons: list[str | None]
    stats: list[dict] = field(default_factory=list)
    status: str = "streaming"  # streaming | done | aborted | error
    error: str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.status != "streaming"

    def as_dict(self) -> dict:
        return asdict(self)


class TurnTemplate:
    """Token ids of single turns that concatenate to the model's full chat-template rendering."""

    MARK = "\u2063@@chatengine-content@@\u2063"

    def __init__(self, engine):
        """engine: LLM or AsyncLLM (its tokenizer, encode and apply_chat_template)."""
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.eos_token_ids = set(engine.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        try:
            self._derive()
            self.incremental = self._check()
        except Exception as e:  # an odd template: render whole conversations instead
            log.warning("chat template turns cannot be derived (%s); re-rendering full conversations", e)
            self.incremental = False
        if not self.incremental:
            log.warning("chat template is not turn-incremental; prompts are re-rendered from text")

    def _render(self, messages, gen: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def _split(self, text: str) -> tuple[str, str]:
        if text.count(self.MARK) != 1:
            raise ValueError("marker not found exactly once")
        before, after = text.split(self.MARK)
        return before, after

    def _delta(self, base: str, full: str) -> str:
        if not full.startswith(base):
            raise ValueError("the rendering of a longer conversation does not extend the shorter one")
        return full[len(base) :]

    def _derive(self) -> None:
        S = {"role": "system", "content": "S"}
        U = {"role": "user", "content": "U"}
        A = {"role": "assistant", "content": "A"}
        M = self.MARK
        self.system_affix = self._split(self._render([{"role": "system", "content": M}], False))
        self.first_user_affix = self._split(self._render([{"role": "user", "content": M}], True))
        base = self._render([S, U, A], False)
        self.user_affix = self._split(self._delta(base, self._render([S, U, A, {"role": "user", "content": M}], True)))
        base = self._render([S, U], True)
        a_before, a_after = self._split(
            self._delta(base, self._render([S, U, {"role": "assistant", "content": M}], False))
        )
        if a_before:
            raise ValueError("the assistant turn has text before its content beyond the generation prompt")
        self.close_ids = self.encode(a_after)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def _check(self) -> bool:
        sample = [
            ("system", "You are a test persona."),
            ("user", "Hi there! <b>x</b>"),
            ("assistant", "Hello, how can I help?\n\n```py\nprint(1)\n```"),
            ("user", "Thanks 🙂 ok"),
        ]
        msgs = [{"role": r, "content": c} for r, c in sample]
        ids = self.system_ids(sample[0][1])
        ids += self.user_ids(sample[1][1])
        ids += self.assistant_ids_from_text(sample[2][1])
        ids += self.user_ids(sample[3][1])
        ok = ids == self.engine.apply_chat_template(msgs)
        hello = [{"role": "user", "content": "Hello"}]
        first = self.first_user_ids("Hello") == self.engine.apply_chat_template(hello)
        return ok and first

    # the pieces ---------------------------------------------------------------------------------
    def system_ids(self, text: str) -> list[int]:
        return self.engine.encode_turn(self.system_affix[0], text, self.system_affix[1])

    def user_ids(self, text: str) -> list[int]:
        """A user turn after earlier turns, with the generation prompt of the reply."""
        return self.engine.encode_turn(self.user_affix[0], text, self.user_affix[1])

    def first_user_ids(self, text: str) -> list[int]:
        """A user turn that opens a conversation without a system message (the template may add
        its default system prompt)."""
        return self.engine.encode_turn(self.first_user_affix[0], text, self.first_user_affix[1])

    def assistant_ids(self, generated: list[int]) -> list[int]:
        """Generated ids, closed like the template closes an assistant turn."""
        ids = list(generated)
        close = self.close_ids
        if ids and close and ids[-1] == close[0]:
            return ids + close[1:]
        if ids and ids[-1] in self.eos_token_ids:  # another end token: the template's closes it
            ids = ids[:-1]
        return ids + close

    def assistant_ids_from_text(self, text: str) -> list[int]:
        return self.engine.encode_turn("", text, "") + self.close_ids


class ChatService:
    def __init__(
        self,
        engine,
        store: ChatStore,
        personas: dict | None = None,
        *,
        default_persona: str | None = "assistant",
        catalog=None,
    ):
        """catalog: a PersonaCatalog (persona_catalog.py): personas that change at run time, some
        private to one user; then `personas` is its live lookup and `personas_for` says who sees what."""
        self.engine = engine
        # the conversations this service creates talk to this model (several served: model_chats.py)
        self.model_id = str(engine.model_id)
        self.store = store
        self.catalog = catalog
        self.personas: Mapping = catalog.lookup if catalog is not None else dict(personas or {})
        if default_persona not in self.personas:
            default_persona = next(iter(self.personas), None)
        self.default_persona = default_persona
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.template = TurnTemplate(engine)
        self._running: dict[tuple[str, str], Generation] = {}  # (user, conversation) -> its reply
        # (user, conversation) -> when its one turn was claimed: one turn at a time per conversation,
        # whatever tab or client asks (a second turn would build on a reply still being written)
        self._claims: dict[str, dict[str, float]] = {}  # user -> {conversation: when}
        self._claim_lock = threading.Lock()  # callers start turns from worker threads
        self.max_message_chars = engine.max_prompt_chars  # longer text is refused before tokenizing
        # replies generated but not saved (disk full): shown as failed until the process ends; the
        # next start marks them interrupted in the database
        self._unsaved: dict[str, str] = {}

    # ---- conversations --------------------------------------------------------------------------
    def new_conversation(
        self, user: str, persona: str | None = None, title: str = DEFAULT_TITLE, settings: dict | None = None
    ) -> str:
        persona = persona or self.default_persona
        visible = self.personas_for(user)
        if persona is not None and persona not in visible:
            raise ValueError("that persona does not exist (any more): pick another one")
        cid = self.store.create_conversation(user, title=title, persona=persona, settings=settings, model=self.model_id)
        if persona is not None:
            prompt = visible[persona].system_prompt
            ids = self.template.system_ids(prompt) if self.template.incremental else None
            self.store.add_message(user, cid, "system", prompt, None, token_ids=ids)
        return cid

    def personas_for(self, user: str) -> Mapping:
        """The personas `user` may start a chat with (another user's private ones are not there)."""
        return self.catalog.visible(user) if self.catalog is not None else self.personas

    def list_conversations(self, user: str, query: str | None = None) -> list[dict]:
        return self.store.list_conversations(user, query=query or None)

    def get_conversation(self, user: str, cid: str) -> dict:
        return self.store.get_conversation(user, cid)

    def rename_conversation(self, user: str, cid: str, title: str) -> None:
        self.store.rename_conversation(user, cid, title)

    def set_pinned(self, user: str, cid: str, pinned: bool) -> None:
        self.store.set_pinned(user, cid, pinned)

    def remember_settings(self, user: str, cid: str, settings, *, touch: bool = True) -> None:
        """Keep the settings with the chat (those of its latest turn, or as the user left them):
        reopening it brings them back. Checked as a turn checks them, so a stored setting is always
        one a turn accepts. touch=False: the chat keeps its place in the list."""
        self.store.update_settings(user, cid, asdict(self._settings(settings)), touch=touch)

    def delete_conversation(self, user: str, cid: str) -> None:
        """Delete the conversation and drop its private KV pages from every cache tier (its text is
        gone from memory and disk, not only from the database). Refused while a reply is written."""
        if self.is_generating(user, cid):
            raise ValueError("a reply is still being written in this conversation: stop it first")
        prompts = self._branch_ids(user, cid)
        self.store.delete_conversation(user, cid)
        if prompts:
            self.engine.forget_prompts(user, prompts)

    def _branch_ids(self, user: str, cid: str) -> list[list[int]]:
        """Token ids of every branch, root to tip: together their blocks are all the conversation's
        cached pages. (A template that is re-rendered per turn gives each user turn's prompt.)"""
        if self.template.incremental:
            branches = [self.store.prompt_token_ids(user, m["id"]) for m in self.store.leaves(user, cid)]
            return [ids for ids in branches if ids]
        users = [m for m in self.store.active_path(user, cid) if m["role"] == "user"]
        return [self.engine.apply_chat_template(self._path_messages(user, m["id"])) for m in users]

    def view(self, user: str, cid: str) -> list[dict]:
        """The active branch without the system message: message dicts plus ``k``, ``n`` (this is
        alternative k of n) and ``sibling_ids``."""
        out = []
        for m in self.store.active_path(user, cid):
            if m["role"] == "system":
                continue
            sibs = [s for s in self.store.siblings(user, m["id"]) if s["role"] == m["role"]]
            ids = [s["id"] for s in sibs]
            if m["id"] in self._unsaved and m["status"] == "streaming":
                m = dict(m, status="error", stats={**(m["stats"] or {}), "error": self._unsaved[m["id"]]})
            out.append(dict(m, k=ids.index(m["id"]) + 1, n=len(ids), sibling_ids=ids))
        return out

    def switch(self, user: str, cid: str, msg_id: str, step: int = 0, *, to: int | None = None) -> str:
        """Show another alternative of ``msg_id``: ``step`` siblings further (clamped), or sibling
        number ``to`` (1-based). The branch on screen continues with that sibling's most recent
        descendant. Returns the id of the sibling now shown."""
        msg = self.store.get_message(user, msg_id)
        if msg["conversation_id"] != cid:
            raise NotFound(f"message {msg_id!r} not found")
        ids = [s["id"] for s in self.store.siblings(user, msg_id) if s["role"] == msg["role"]]
        k = ids.index(msg_id) if to is None else int(to) - 1
        k = min(max(k + (step if to is None else 0), 0), len(ids) - 1)
        target = ids[k]
        self.store.set_active_leaf(user, cid, self.store.latest_leaf(user, target))
        return target

    # ---- turns ----------------------------------------------------------------------------------
    def send(self, user: str, cid: str, text: str, settings=None) -> Generation:
        """Append a user message after the active leaf; its reply is the Generation returned (it runs
        once started or followed)."""
        text = self._user_text(text)
        s = self._settings(settings)
        conv = self.store.get_conversation(user, cid)
        leaf = conv["active_leaf_id"]
        if leaf is not None:
            leaf_msg = self.store.get_message(user, leaf)
            if leaf_msg["role"] == "user":  # a user turn without reply (error): answer below it
                leaf = leaf_msg["parent_id"]
        return self._new_user_turn(user, cid, leaf, text, s, conv)

    def edit(self, user: str, cid: str, user_msg_id: str, text: str, settings=None) -> Generation:
        """Fork: a sibling of ``user_msg_id`` with ``text``, and a reply to it."""
        text = self._user_text(text)
        s = self._settings(settings)
        conv = self.store.get_conversation(user, cid)
        msg = self.store.get_message(user, user_msg_id)
        if msg["conversation_id"] != cid or msg["role"] != "user":
            raise NotFound(f"user message {user_msg_id!r} not found")
        return self._new_user_turn(user, cid, msg["parent_id"], text, s, conv)

    def regenerate(self, user: str, cid: str, msg_id: str | None = None, settings=None) -> Generation:
        """Add alternative replies (``settings.n`` of them) beside ``msg_id`` (an assistant
        message; None: the active leaf), or replies to ``msg_id`` if it is a user message."""
        s = self._settings(settings)
        conv = self.store.get_conversation(user, cid)
        msg_id = msg_id or conv["active_leaf_id"]
        if msg_id is None:
            raise ValueError("nothing to regenerate: the conversation is empty")
        msg = self.store.get_message(user, msg_id)
        if msg["conversation_id"] != cid:
            raise NotFound(f"message {msg_id!r} not found")
        if msg["role"] == "assistant":
            parent = msg["parent_id"]
        elif msg["role"] == "user":
            parent = msg_id
        else:
            raise ValueError("regenerate needs a reply or a user message")
        prompt = self._prompt(user, parent)
        self._check_length(prompt, s)
        existing = len(self.store.children(user, parent))
        self._claim(user, cid)
        return self._generate(user, cid, parent, prompt, s, seed_offset=existing)

    def continue_reply(self, user: str, cid: str, msg_id: str, settings=None) -> Generation:
        """Write more of a reply cut at max tokens, into the same message: the prompt is its history
        plus the ids it generated (without the turn's close), so the model goes on where it stopped."""
        s = self._settings(settings)
        s.n = 1
        msg = self.store.get_message(user, msg_id)
        if msg["conversation_id"] != cid or msg["role"] != "assistant":
            raise NotFound(f"reply {msg_id!r} not found")
        if msg["status"] != "done" or (msg["stats"] or {}).get("finish_reason") != "length":
            raise ValueError("only a reply cut at max tokens can be continued")
        if not self.template.incremental:
            raise ValueError("this model's chat template is re-rendered from text: its replies cannot be continued")
        generated = self._generated_ids(msg)
        prompt = self._path_ids(user, msg["parent_id"]) + generated
        self._check_length(prompt, s)
        self._claim(user, cid)
        return self._generate(user, cid, msg["parent_id"], prompt, s, seed_offset=1, into=(msg, generated))

    def _generated_ids(self, msg: dict) -> list[int]:
        """The ids a stored reply generated: its stored ids without the close that ends the turn."""
        tpl = self.template
        ids = msg["token_ids"] or tpl.assistant_ids_from_text(msg["content"])
        close = tpl.close_ids
        return ids[: -len(close)] if close and ids[-len(close) :] == close else ids

    async def stop(self, user: str, cid: str, timeout: float = 10.0) -> bool:
        """Abort the generation running in this conversation; the partial replies are kept (status
        "aborted"). Waits until they are stored; its followers then get the final, "aborted" update.
        Returns whether anything was running."""
        gen = self.attach(user, cid)
        if gen is None:
            return False
        gen.stop_requested = True  # a generation not yet submitted to the engine ends before it is
        await self.engine.abort(gen.request_id)
        if gen.task is not None:
            try:
                await asyncio.wait_for(gen.done.wait(), timeout)
            except TimeoutError:
                log.warning("stop: generation did not finish within %.0f s", timeout)
        return True

    def attach(self, user: str, cid: str) -> Generation | None:
        """The generation running in ``user``'s conversation ``cid`` (None: none): follow it with
        ``async for``. NotFound for a conversation of another user, as for one that does not exist."""
        self.store.get_conversation(user, cid)
        return self._running.get((user, cid))

    def is_generating(self, user: str, cid: str) -> bool:
        gen = self._running.get((user, cid))
        return gen is not None and gen.task is not None

    def _claim(self, user: str, cid: str) -> None:
        """Reserve the conversation's one turn, or refuse: a reply is still being written there, or
        in MAX_REPLIES_PER_USER of the user's other conversations. A claim whose generation never
        started (its caller dropped it) lapses after CLAIM_LAPSE_S."""
        with self._claim_lock:
            claims = self._claims.setdefault(user, {})
            for c in [c for c, since in claims.items() if not self._live(user, c, since)]:
                del claims[c]  # lapsed: its caller never streamed it
            if cid in claims:
                raise ValueError(
                    "a reply is still being written in this conversation: stop it or wait for it to finish"
                )
            if len(claims) >= MAX_REPLIES_PER_USER:
                raise ValueError(
                    f"{MAX_REPLIES_PER_USER} of your replies are being written in other conversations: "
                    "stop one or wait for one to finish"
                )
            claims[cid] = time.monotonic()

    def _live(self, user: str, cid: str, since: float) -> bool:
        """Whether a claim holds: its reply runs, or it was made lately."""
        gen = self._running.get((user, cid))
        return gen is not None and gen.task is not None or time.monotonic() - since < CLAIM_LAPSE_S

    def _unclaim(self, user: str, cid: str) -> None:
        with self._claim_lock:
            claims = self._claims.get(user, {})
            claims.pop(cid, None)
            if not claims:
                self._claims.pop(user, None)

    # ---- internals ------------------------------------------------------------------------------
    def _user_text(self, text) -> str:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the message is empty")
        if len(text) > self.max_message_chars:
            raise ValueError(
                f"the message is {len(text):,} characters long; this model reads at most {self.max_model_len:,} "
                f"tokens (about {self.max_message_chars:,} characters): shorten it or send it in parts"
            )
        return text

    def _settings(self, settings) -> ChatSettings:
        s = ChatSettings.from_any(settings)
        # validate now, before anything is written
        SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=s.seed).validate(
            self.engine.max_n, self.engine.max_tokens_limit
        )
        return s

    def _check_length(self, prompt: list[int], s: ChatSettings) -> None:
        if self.max_model_len and len(prompt) >= self.max_model_len:
            raise ValueError(
                f"this conversation has {len(prompt)} tokens but the model's context is "
                f"{self.max_model_len}; start a new chat (or edit an earlier message)"
            )

    def _new_user_turn(self, user, cid, parent, text, s: ChatSettings, conv) -> Generation:
        tpl = self.template
        if tpl.incremental:
            if parent is None:
                new_ids = tpl.first_user_ids(text)
                prompt = list(new_ids)
            else:
                prompt = self._path_ids(user, parent)
                new_ids = tpl.user_ids(text)
                prompt = prompt + new_ids
        else:
            new_ids = None
            msgs = [] if parent is None else self._path_messages(user, parent)
            prompt = self.engine.apply_chat_template(msgs + [{"role": "user", "content": text}])
        self._check_length(prompt, s)
        self._claim(user, cid)
        try:
            umid = self.store.add_message(user, cid, "user", text, parent, token_ids=new_ids)
        except BaseException:
            self._unclaim(user, cid)
            raise
        if conv["title"] == DEFAULT_TITLE:  # name the chat after its first message
            self.store.rename_conversation(user, cid, _title_from(text))
        return self._generate(user, cid, umid, prompt, s, seed_offset=0)

    def _path_messages(self, user, msg_id) -> list[dict]:
        return [{"role": m["role"], "content": m["content"]} for m in self.store.path_to(user, msg_id)]

    def _path_ids(self, user, msg_id) -> list[int]:
        """The stored ids from the root to ``msg_id``; a message without ids gets them re-derived
        from its text (and stored), so the path is whole again."""
        ids: list[int] = []
        tpl = self.template
        for i, m in enumerate(self.store.path_to(user, msg_id)):
            t = m["token_ids"]
            if t is None:
                if m["role"] == "system":
                    t = tpl.system_ids(m["content"])
                elif m["role"] == "user":
                    t = tpl.first_user_ids(m["content"]) if i == 0 else tpl.user_ids(m["content"])
                else:
                    t = tpl.assistant_ids_from_text(m["content"])
                self.store.update_message(user, m["id"], token_ids=t)
            ids += t
        return ids

    def _prompt(self, user, user_msg_id) -> list[int]:
        if self.template.incremental:
            return self._path_ids(user, user_msg_id)
        return self.engine.apply_chat_template(self._path_messages(user, user_msg_id))

    def _generate(
        self,
        user,
        cid,
        parent_id,
        prompt,
        s: ChatSettings,
        seed_offset: int,
        into: tuple[dict, list[int]] | None = None,
    ) -> Generation:
        """One engine request with n samples into n new assistant siblings under ``parent_id`` (or, with
        ``into`` = (reply, its generated ids), appended to that reply), as a Generation of this
        conversation (it runs once started or followed)."""
        seed = s.seed + seed_offset if s.seed is not None else random.randrange(2**31)
        params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=seed)
        settings = dict(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=seed, n=s.n)
        up = ReplyUpdate(
            cid,
            parent_id,
            [],
            [into[0]["content"] if into else ""] * s.n,
            [len(into[1]) if into else 0] * s.n,
            [None] * s.n,
            stats=[{} for _ in range(s.n)],
            num_prompt_tokens=len(prompt),
        )

        async def run(gen: Generation) -> None:
            await self._run(gen, user, cid, parent_id, prompt, params, settings, into)

        gen = Generation(f"chat-{uuid.uuid4().hex}", up, run)
        self._running[(user, cid)] = gen
        return gen

    async def _run(self, gen: Generation, user, cid, parent_id, prompt, params: SamplingParams, settings: dict, into):
        """The task of a Generation: write the reply rows, stream the engine's outputs into them (saved
        every SAVE_EVERY_S), store the final state, then free the conversation and end."""
        run = _Reply(self, user, gen.update, prefix=into)
        stream = None
        try:
            try:
                gen.update.message_ids = await asyncio.to_thread(
                    self._add_replies, user, cid, parent_id, settings, params.n, into
                )
            except StoreWriteError as e:  # a full disk: nothing was written
                run.up.status, run.up.error = "error", str(e)
                return
            gen.publish()
            if not gen.stop_requested:  # Stop may come before the engine has the request
                stream = self.engine.generate(prompt, params, request_id=gen.request_id, user=user)
                try:
                    async for out in stream:
                        if run.absorb(out):
                            break
                        if run.save_due():  # every SAVE_EVERY_S, in a worker thread (an fsync stalls a loop)
                            await _in_thread(run.save_partial)
                        gen.publish()
                except ValueError as e:  # the engine refused the request (length, memory)
                    run.up.error = str(e)
            try:
                await asyncio.to_thread(run.finish, gen.stop_requested or stream is None)
            except StoreWriteError as e:  # the reply was generated but cannot be kept: say so
                run.failed_to_save(str(e))
                self._unsaved.update(dict.fromkeys(run.up.message_ids, str(run.up.error)))
        except asyncio.CancelledError:  # only the server's shutdown cancels a generation
            await _in_thread(lambda: run.keep_partial("interrupted"))
            raise
        except Exception as e:  # a bug: the reply says so rather than stay "streaming"
            log.exception("generation %s failed", gen.request_id)
            run.up.error = f"generation failed: {e}"
            await _in_thread(lambda: run.keep_partial("error"))
        finally:
            if stream is not None:
                await _close_quietly(stream)
            try:
                await _in_thread(lambda: run.keep_partial("aborted"))
            finally:
                # free the conversation before the final update: a follower may send the next turn at once
                if self._running.get((user, cid)) is gen:
                    del self._running[(user, cid)]
                self._unclaim(user, cid)
                gen.end()

    def _add_replies(self, user, cid, parent_id, settings: dict, n: int, into=None) -> list[str]:
        """n empty "streaming" assistant messages under parent_id (the first becomes the active leaf);
        with ``into``, that reply, "streaming" again."""
        if into is not None:
            self.store.update_message(user, into[0]["id"], status="streaming")
            self.store.set_active_leaf(user, cid, into[0]["id"])
            return [into[0]["id"]]
        return [
            self.store.add_message(
                user,
                cid,
                "assistant",
                "",
                parent_id,
                status="streaming",
                settings=dict(settings, index=i),
                activate=(i == 0),
            )
            for i in range(n)
        ]


async def _in_thread(fn) -> None:
    """fn() in a worker thread, finished even if this task is cancelled meanwhile; in place when the
    loop is shutting down and has no executor left."""
    try:
        await asyncio.shield(asyncio.to_thread(fn))
    except RuntimeError:
        fn()


async def _close_quietly(stream) -> None:
    try:
        await stream.aclose()
    except Exception:  # pragma: no cover - defensive: closing must never mask the reply's own end
        pass


class _Reply:
    """The bookkeeping of one generation: its ReplyUpdate, timings, and saving it to the store."""

    def __init__(self, service: ChatService, user: str, up: ReplyUpdate, prefix: tuple[dict, list[int]] | None = None):
        """prefix: (the reply being continued, its generated ids): the new text and ids go after them."""
        self.service, self.user, self.up = service, user, up
        self.prefix_text = prefix[0]["content"] if prefix else ""
        self.prefix_ids = prefix[1] if prefix else []
        self.n = len(up.texts)
        self.t0 = self.last_save = time.monotonic()
        self.t_first: float | None = None
        self.t_end: list[float | None] = [None] * self.n
        self.last: Any = None  # the engine's latest RequestOutput

    def absorb(self, out) -> bool:
        """Take one engine output; True when it is the last."""
        up, now = self.up, time.monotonic()
        self.last = out
        if self.t_first is None:
            self.t_first = now
        up.num_cached_tokens = out.num_cached_tokens
        for c in out.outputs[: self.n]:
            up.texts[c.index] = self.prefix_text + c.text
            up.num_tokens[c.index] = len(self.prefix_ids) + len(c.token_ids)
            if c.finish_reason and up.finish_reasons[c.index] is None:
                up.finish_reasons[c.index], self.t_end[c.index] = c.finish_reason, now
        if out.error:
            up.error = out.error
        if out.finished:
            return True
        up.stats = [self.stats_for(i, now) for i in range(self.n)]
        return False

    def save_due(self) -> bool:
        """Whether the partial texts are due for saving (every SAVE_EVERY_S); the clock restarts."""
        now = time.monotonic()
        if now - self.last_save < SAVE_EVERY_S:
            return False
        self.last_save = now
        return True

    def stats_for(self, i: int, now: float) -> dict:
        up, end = self.up, self.t_end[i] or now
        ntok = up.num_tokens[i]
        new = ntok - len(self.prefix_ids)  # a continued reply: its speed is this request's
        st: dict = {"tokens": ntok, "prompt_tokens": up.num_prompt_tokens, "cached_tokens": up.num_cached_tokens}
        if self.t_first is not None:
            st["ttft_ms"] = round((self.t_first - self.t0) * 1000, 1)
            if new > 1 and end > self.t_first:
                st["tok_s"] = round((new - 1) / (end - self.t_first), 2)
        st["duration_ms"] = round((end - self.t0) * 1000, 1)
        if up.finish_reasons[i]:
            st["finish_reason"] = up.finish_reasons[i]
        return st

    def finish(self, stop_requested: bool) -> None:
        up = self.up
        if up.error:
            up.status = "error"
        elif stop_requested or any(r == "abort" for r in up.finish_reasons):
            up.status = "aborted"
        else:
            up.status = "done"
        self.save(up.status)

    def save_partial(self) -> None:
        """Save the texts so far; a failed write is logged (the final save tries again and says so)."""
        try:
            self.save(None)
        except StoreWriteError as e:
            log.warning("could not save a partial reply: %s", e)

    def failed_to_save(self, reason: str) -> None:
        up = self.up
        up.status, up.error = "error", f"this reply could not be saved: {reason}"
        up.stats = [dict(st, error=up.error) for st in up.stats]

    def keep_partial(self, status: str) -> None:
        """The generation ended before finish() (the server shuts down: "interrupted"; an
        unexpected error: "aborted"): save what came."""
        up = self.up
        if up.status != "streaming" or not up.message_ids:
            return
        up.status = status
        up.finish_reasons = [r or "abort" for r in up.finish_reasons]
        try:
            self.save(status)
        except Exception:
            log.exception("could not save the partial reply")

    def save(self, final_status: str | None) -> None:
        """Write the texts (and, once final, status, stats and token ids) of every alternative."""
        up, store, now = self.up, self.service.store, time.monotonic()
        outs: list = self.last.outputs if self.last is not None else []
        for i, mid in enumerate(up.message_ids):
            st = self.stats_for(i, now)
            if final_status is None:
                store.update_message(self.user, mid, content=up.texts[i], stats=st)
                continue
            status = "aborted" if final_status == "done" and up.finish_reasons[i] == "abort" else final_status
            ids = (
                self.service.template.assistant_ids(self.prefix_ids + (outs[i].token_ids if i < len(outs) else []))
                if self.service.template.incremental
                else None
            )
            if up.error:
                st["error"] = up.error
            up.stats[i] = st
            store.update_message(self.user, mid, content=up.texts[i], token_ids=ids, stats=st, status=status)


def _title_from(text: str) -> str:
    """A title as a person would write it: the first line with text, without markdown's heading,
    quote or list marks, cut at a word within TITLE_CHARS."""
    line = next((ln for ln in text.splitlines() if ln.strip()), text)
    line = " ".join(re.sub(r"^\s*(#{1,6}\s+|>\s*|[-*+]\s+|\d+[.)]\s+)", "", line).split()) or " ".join(text.split())
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[: TITLE_CHARS - 1]
    if " " in cut[TITLE_CHARS // 2 :]:  # end at a word when one ends in the second half
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:-") + "…"
