"""Export of a conversation: Markdown of the branch on screen, JSON of the whole tree, and the
GET /export/<id>.<fmt> route, which serves only the signed-in user's own chats."""

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from chatengine.app.export import add_export_route, export, file_stem
from chatengine.app.store import NotFound


@pytest.fixture
def chat(store):
    """alice's chat: a question with two answers (the second on screen), under a system prompt."""
    cid = store.create_conversation("alice", title="Moon & <stars>", persona="assistant")
    root = store.add_message("alice", cid, "system", "You are helpful.")
    q = store.add_message("alice", cid, "user", "What is the moon?", root)
    a1 = store.add_message("alice", cid, "assistant", "A rock.", q)
    a2 = store.add_message("alice", cid, "assistant", "Earth's satellite.", q, status="aborted")
    return cid, (root, q, a1, a2)


def test_markdown_is_the_branch_on_screen(store, chat):
    cid, _ = chat
    name, text = export(store, "alice", cid, "md")
    assert name == "Moon-stars.md"
    assert text.startswith("# Moon & <stars>\n") and "persona: assistant" in text
    assert "**You:**\n\nWhat is the moon?" in text and "**Assistant:** *(aborted)*\n\nEarth's satellite." in text
    assert "A rock." not in text and "You are helpful." not in text


def test_json_is_the_whole_tree(store, chat):
    cid, (root, q, a1, a2) = chat
    name, text = export(store, "alice", cid, "json")
    data = json.loads(text)
    assert name == "Moon-stars.json" and data["conversation"]["id"] == cid
    assert [(m["id"], m["parent_id"]) for m in data["messages"]] == [(root, None), (q, root), (a1, q), (a2, q)]
    assert data["active_path"] == [root, q, a2]
    assert "token_ids" not in data["messages"][0] and "user_id" not in data["conversation"]


def test_another_users_chat_is_not_found(store, chat):
    cid, _ = chat
    with pytest.raises(NotFound):
        export(store, "bob", cid, "md")
    with pytest.raises(ValueError, match="md, json"):
        export(store, "alice", cid, "html")


@pytest.mark.parametrize(
    "title, stem", [("Hello world!", "Hello-world"), ("../../etc/passwd", "etc-passwd"), ("???", "chat"), ("é", "é")]
)
def test_file_names_are_safe(title, stem):
    assert file_stem(title) == stem


def test_the_route_serves_only_the_signed_in_users_chats(store, chat):
    cid, _ = chat
    app = FastAPI()
    add_export_route(app, store, lambda request: {"a": "alice", "b": "bob"}.get(request.headers.get("x-who", "")))
    http = TestClient(app)
    r = http.get(f"/export/{cid}.md", headers={"x-who": "a"})
    assert r.status_code == 200 and "What is the moon?" in r.text
    assert r.headers["content-disposition"].startswith('attachment; filename="Moon-stars.md"')
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
    assert http.get(f"/export/{cid}.json", headers={"x-who": "a"}).json()["conversation"]["id"] == cid
    # bob, nobody, a made-up id and a bad format learn nothing of alice's chat
    assert http.get(f"/export/{cid}.md", headers={"x-who": "b"}).status_code == 404
    assert http.get(f"/export/{cid}.md").status_code == 401
    assert http.get("/export/no-such-id.md", headers={"x-who": "a"}).status_code == 404
    r = http.get(f"/export/{cid}.html", headers={"x-who": "a"})
    assert r.status_code == 400 and "moon" not in r.text
