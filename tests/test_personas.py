"""Persona files in prompts/. Run: python -m pytest tests/test_personas.py -q"""

import pytest

from chatengine import personas as personas_mod
from chatengine.personas import DEFAULT_PERSONA, Persona, load_personas, parse_persona

GOOD = """---
name: tester
title: Tester
description: A persona for tests.
---
You are a test persona.
"""


def test_shipped_personas():
    personas = load_personas()
    assert len(personas) >= 6
    assert next(iter(personas)) == DEFAULT_PERSONA
    assert list(personas)[1:] == sorted(list(personas)[1:])
    for name, p in personas.items():
        assert isinstance(p, Persona) and p.name == name
        assert p.title and p.description and p.system_prompt
        assert p.system_prompt == p.system_prompt.strip()
        assert "---" not in p.system_prompt
        # written for a 135M model: a few short sentences
        assert len(p.system_prompt) < 600, name


def test_parse_good():
    p = parse_persona(GOOD, "tester.md")
    assert p == Persona("tester", "Tester", "A persona for tests.", "You are a test persona.")
    crlf = "\ufeff" + GOOD.replace("\n", "\r\n").replace("Tester", '"Tester"') + "\n\n"
    assert parse_persona(crlf) == p


@pytest.mark.parametrize(
    "text, message",
    [
        ("no front matter\n", "must start"),
        ("---\nname: x\ntitle: X\ndescription: d\nbody\n", "not closed"),
        (GOOD.replace("title: Tester\n", ""), "'title'"),
        (GOOD.replace("description: A persona for tests.", "description:"), "'description'"),
        (GOOD.replace("name: tester", "name: Bad Name"), "a-z"),
        (GOOD.replace("title: Tester", "title Tester"), "key: value"),
        (GOOD.replace("title: Tester", "title: Tester\ntitle: Again"), "duplicate"),
        (GOOD.replace("You are a test persona.\n", "  \n"), "empty"),
    ],
)
def test_malformed_raises_with_file_name(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_persona(text, "prompts/broken.md")
    assert "prompts/broken.md" in str(e.value)


def test_load_directory(tmp_path):
    (tmp_path / "tester.md").write_text(GOOD)
    (tmp_path / "assistant.md").write_text(GOOD.replace("tester", "assistant"))
    (tmp_path / "notes.txt").write_text("ignored")
    assert list(load_personas(tmp_path)) == ["assistant", "tester"]

    (tmp_path / "broken.md").write_text(GOOD.replace("name: tester\n", ""))
    with pytest.raises(ValueError, match="broken.md"):
        load_personas(tmp_path)


def test_name_must_match_file(tmp_path):
    (tmp_path / "other.md").write_text(GOOD)
    with pytest.raises(ValueError, match="other.md"):
        load_personas(tmp_path)


def test_missing_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(personas_mod, "PROMPTS_DIR", tmp_path / "absent")
    assert load_personas() == {}  # installed without prompts/: no personas, no crash
    with pytest.raises(ValueError, match="does not exist"):
        load_personas(tmp_path / "absent")
