"""PersonaCatalog: the personas users pick from, kept in the chat database (the `personas` table).

The files in prompts/ are the seed: each becomes a public row at start, refreshed from its file
while nobody has edited it. Admins make, edit and delete public personas and flip them between
public and private; any user makes private personas of their own.

Cache isolation: a public persona's prefix is registered with the engine (register_persona, as the
engine does for prompts/ at start), so its KV pages are shared by every user, and it is warmed on
save (one 1-token request, so the first user does not pay for its prefill). A private persona is
never registered: its system prompt is private text, salted per user like every conversation, so
its pages are never shared across users. A public persona made private or deleted is unregistered
at once (unregister_persona: the engine drops its shared pages), and at start every persona that
is not public is unregistered (the engine registers the files in prompts/ itself).

Who may see and change what: public personas are visible to all; a private one only to its owner,
and another user's private persona behaves as one that does not exist (NotFound), admins included.
Only admins make a persona public or change a public one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping

from chatengine.app.store import ChatStore, NotFound
from chatengine.personas import DEFAULT_PERSONA, Persona
from chatengine.sampling_params import SamplingParams

MAX_TITLE_CHARS = 60
MAX_DESCRIPTION_CHARS = 200
MAX_PROMPT_CHARS = 8000
MAX_PER_USER = 100  # personas one user may own: the form is open to everyone, the table is not a dump
# the title and description are shown in Markdown (the chat header): no links, images or HTML there
UNSAFE_CHARS = set("<>[]`\\")


def _line(value: object, what: str, limit: int, required: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"the {what} must be text")
    value = " ".join(value.split())  # one line: no newlines or tabs in a header
    if required and not value:
        raise ValueError(f"the {what} must not be empty")
    if len(value) > limit:
        raise ValueError(f"the {what} is {len(value)} characters long; the limit is {limit}")
    bad = sorted(UNSAFE_CHARS.intersection(value))
    if bad:
        raise ValueError(f"the {what} may not contain {' '.join(bad)}")
    if any(ord(c) < 32 or 0xD800 <= ord(c) < 0xE000 for c in value):
        raise ValueError(f"the {what} contains control characters")
    return value


def _prompt(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("the system prompt must not be empty")
    value = value.strip()  # as a file's prompt: trailing newlines would change its token ids
    if len(value) > MAX_PROMPT_CHARS:
        raise ValueError(f"the system prompt is {len(value):,} characters long; the limit is {MAX_PROMPT_CHARS:,}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the system prompt is not valid Unicode text") from None
    return value


def _persona(row: dict) -> Persona:
    return Persona(row["key"], row["title"], row["description"], row["system_prompt"])


class PersonaCatalog:
    def __init__(self, store: ChatStore, engines, seeds: Mapping[str, Persona]):
        """engines: an AsyncLLM (register_persona, apply_chat_template, generate), or a list of them
        (every served model's: a public persona is shared and warmed in each). seeds: prompts/."""
        self.store = store
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.engine = self.engines[0]
        self._seed(seeds)
        for row in self._query("public = 1"):
            self._register(_persona(row))
        # the engine registered prompts/ at its start: a seed an admin made private or deleted is not shared
        for row in self.store.db.query("SELECT key FROM personas WHERE public = 0 OR deleted = 1"):
            self._unregister(row["key"])
        self.lookup = _Lookup(self)

    # ---- reading -------------------------------------------------------------------------------
    def _query(self, where: str, params: list | None = None) -> list[dict]:
        sql = f"SELECT * FROM personas WHERE deleted = 0 AND ({where}) ORDER BY key != ?, title, key"
        return list(self.store.db.query(sql, [*(params or []), DEFAULT_PERSONA]))

    def visible(self, user: str) -> dict[str, Persona]:
        """The personas `user` may pick: every public one and their own, the default first."""
        return {r["key"]: _persona(r) for r in self._query("public = 1 OR owner = ?", [user])}

    def rows(self, user: str, admin: bool) -> list[dict]:
        """What `user` may edit, as rows (key, owner, title, description, system_prompt, public):
        their own personas, and for an admin every public one and the seeds too."""
        if admin:
            return self._query("public = 1 OR owner IS NULL OR owner = ?", [user])
        return self._query("owner = ?", [user])

    def get(self, key: object) -> Persona | None:
        """Any persona by key (None: none). Callers that take a key from a user check visible()."""
        if not isinstance(key, str):
            return None
        rows = self._query("key = ?", [key])
        return _persona(rows[0]) if rows else None

    def _editable(self, user: str, key: str, admin: bool) -> dict:
        for row in self.rows(user, admin):
            if row["key"] == key:
                return row
        raise NotFound(f"persona {key!r} not found")

    # ---- changes -------------------------------------------------------------------------------
    def create(
        self, user: str, title: object, description: object, prompt: object, *, public: bool = False, admin: bool
    ) -> str:
        """A new persona owned by `user`; only an admin may make it public. Returns its key."""
        if public and not admin:
            raise PermissionError("only admins make public personas")
        if len(self._query("owner = ?", [user])) >= MAX_PER_USER:
            raise ValueError(f"you have {MAX_PER_USER} personas already: delete one first")
        key = uuid.uuid4().hex
        p = dict(key=key, owner=user, **_fields(title, description, prompt, public))
        with self.store._write() as db:
            db.execute("INSERT INTO users (id, created_at) VALUES (:owner, :now) ON CONFLICT (id) DO NOTHING", p)
            db.execute(
                "INSERT INTO personas (key, owner, title, description, system_prompt, public, from_file,"
                " created_at, updated_at) VALUES (:key, :owner, :title, :description, :system_prompt,"
                " :public, 0, :now, :now)",
                p,
            )
        if public:
            self._register(self.get(key))
        return key

    def update(
        self, user: str, key: str, title: object, description: object, prompt: object, *, public: bool, admin: bool
    ) -> None:
        """Change a persona `user` may edit. A private persona stays private unless an admin says so."""
        row = self._editable(user, key, admin)
        if (row["public"] or public) and not admin:
            raise PermissionError("only admins change public personas")
        p = dict(key=key, **_fields(title, description, prompt, public))
        with self.store._write() as db:
            db.execute(
                "UPDATE personas SET title = :title, description = :description, system_prompt = :system_prompt,"
                " public = :public, from_file = 0, updated_at = :now WHERE key = :key",
                p,
            )
        if public:
            self._register(self.get(key))
        else:  # made private (or kept so): no other user may hit its prefix from now on
            self._unregister(key)

    def delete(self, user: str, key: str, *, admin: bool) -> None:
        """Remove a persona (conversations made with it keep their system message)."""
        row = self._editable(user, key, admin)
        if row["public"] and not admin:
            raise PermissionError("only admins delete public personas")
        if key == DEFAULT_PERSONA:
            raise ValueError("the default persona cannot be deleted; edit it instead")
        with self.store._write() as db:
            if row["owner"] is None:  # a seed: a tombstone, so the file does not bring it back
                db.execute("UPDATE personas SET deleted = 1, updated_at = ? WHERE key = ?", [time.time(), key])
            else:
                db.execute("DELETE FROM personas WHERE key = ?", [key])
        self._unregister(key)

    # ---- the engine -----------------------------------------------------------------------------
    def _register(self, persona: Persona | None) -> None:
        """Share the persona's prefix across users (public personas only: the caller checked)."""
        if persona is not None:
            for engine in self.engines:
                engine.register_persona(persona.name, persona.system_prompt)

    def _unregister(self, key: str) -> None:
        """Stop sharing the persona's prefix across users (a no-op where it is not registered)."""
        for engine in self.engines:
            engine.unregister_persona(key)

    @staticmethod
    def prefix_ids(engine, system_prompt: str) -> list[int]:
        """The token ids every conversation opening with this system prompt starts with (what the
        engine registers): where two renderings with different user turns part."""
        system = [{"role": "system", "content": system_prompt}]
        a = engine.apply_chat_template(system + [{"role": "user", "content": "a"}])
        b = engine.apply_chat_template(system + [{"role": "user", "content": "Zz 9"}])
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n]

    async def warm(self, key: str) -> int:
        """Compute a public persona's prefix into every engine's KV cache now; returns its length in
        tokens (the default model's). The requests have no user: their pages are unsalted, the same
        pages every user's prefix hits."""
        persona = self.get(key)
        rows = self._query("key = ? AND public = 1", [key])
        if persona is None or not rows:
            raise NotFound(f"public persona {key!r} not found")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        lengths = []
        for engine in self.engines:
            ids = self.prefix_ids(engine, persona.system_prompt)
            async for _ in engine.generate(ids, params, request_id=f"warm-{uuid.uuid4().hex}", user=None):
                pass
            lengths.append(len(ids))
        return lengths[0]

    def _seed(self, seeds: Mapping[str, Persona]) -> None:
        """prompts/ into the table: new files become public rows; unedited rows follow their file."""
        now = time.time()
        with self.store._write() as db:
            for p in seeds.values():
                db.execute(
                    "INSERT INTO personas (key, owner, title, description, system_prompt, public, from_file,"
                    " created_at, updated_at) VALUES (?, NULL, ?, ?, ?, 1, 1, ?, ?) ON CONFLICT (key) DO UPDATE"
                    " SET title = excluded.title, description = excluded.description,"
                    " system_prompt = excluded.system_prompt WHERE personas.from_file = 1",
                    [p.name, p.title, p.description, p.system_prompt, now, now],
                )


class _Lookup(Mapping):
    """Any persona by key (for headers of a user's own conversations); iterates over the public ones
    only, which is what a page shows before it knows its user."""

    def __init__(self, catalog: PersonaCatalog):
        self.catalog = catalog

    def __getitem__(self, key: str) -> Persona:
        persona = self.catalog.get(key)
        if persona is None:
            raise KeyError(key)
        return persona

    def __iter__(self) -> Iterator[str]:
        return iter(r["key"] for r in self.catalog._query("public = 1"))

    def __len__(self) -> int:
        return len(self.catalog._query("public = 1"))


def _fields(title: object, description: object, prompt: object, public: bool) -> dict:
    """The checked columns of a new or edited persona (ValueError names the bad field)."""
    return dict(
        title=_line(title, "title", MAX_TITLE_CHARS, True),
        description=_line(description, "description", MAX_DESCRIPTION_CHARS, False),
        system_prompt=_prompt(prompt),
        public=int(bool(public)),
        now=time.time(),
    )
