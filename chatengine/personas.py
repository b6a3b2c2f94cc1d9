"""Personas: the public system prompts in prompts/*.md that every user may pick.

A persona file is front matter between two `---` lines (`name`, `title`, `description`, as
simple `key: value` lines), then the system prompt text. Persona prompts are public and their KV
blocks are shared by all users (docs/ARCHITECTURE.md, isolation), so nothing secret belongs in them.
"""

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PERSONA = "assistant"
PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"  # absent in a non-editable install
REQUIRED_FIELDS = ("name", "title", "description")
_NAME = re.compile(r"[a-z0-9-]+")


@dataclass(frozen=True)
class Persona:
    name: str
    title: str
    description: str
    system_prompt: str


def parse_persona(text: str, source: str = "") -> Persona:
    where = source or "<persona text>"

    def fail(msg: str) -> ValueError:
        return ValueError(f"{where}: {msg}")

    lines = text.lstrip("\ufeff").replace("\r\n", "\n").split("\n")
    if not lines or lines[0].strip() != "---":
        raise fail("must start with a '---' line opening the front matter")
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        raise fail("front matter is not closed by a second '---' line") from None

    fields: dict[str, str] = {}
    for lineno, line in enumerate(lines[1:end], start=2):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise fail(f"line {lineno}: expected 'key: value', got {line!r}")
        if key in fields:
            raise fail(f"line {lineno}: duplicate field {key!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]  # allow YAML-style quoted values
        fields[key] = value

    for key in REQUIRED_FIELDS:
        if not fields.get(key):
            raise fail(f"missing or empty front-matter field {key!r}")
    if not _NAME.fullmatch(fields["name"]):
        raise fail(f"name {fields['name']!r} must use only a-z, 0-9 and '-'")
    # Stripped, so the prompt's token ids (and so its shared KV blocks) do not depend on
    # trailing newlines an editor may add.
    system_prompt = "\n".join(lines[end + 1 :]).strip()
    if not system_prompt:
        raise fail("the system prompt after the front matter is empty")
    return Persona(fields["name"], fields["title"], fields["description"], system_prompt)


def load_personas(directory=None) -> dict[str, Persona]:
    """All personas in `directory` (default: the repo's prompts/), sorted by name with the
    default persona first. A missing default folder gives {}; a missing explicit one raises."""
    if directory is None:
        directory = PROMPTS_DIR
        if not directory.is_dir():
            return {}
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"persona directory {directory} does not exist")

    personas: dict[str, Persona] = {}
    for path in sorted(directory.glob("*.md")):
        persona = parse_persona(path.read_text(encoding="utf-8"), source=str(path))
        if persona.name != path.stem:  # also rules out two files claiming one name
            raise ValueError(f"{path}: name {persona.name!r} does not match the file name {path.stem!r}")
        personas[persona.name] = persona
    order = sorted(personas, key=lambda n: (n != DEFAULT_PERSONA, n))
    return {n: personas[n] for n in order}
