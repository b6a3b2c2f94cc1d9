"""Several models behind one API: /v1/models lists them all, a request's `model` picks its engine
(exact ids only; an unknown one is a 404 naming the served), no model is the default (the first)."""

import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from chatengine import AsyncLLM  # noqa: E402
from chatengine.app.api.routes import build_api  # noqa: E402
from chatengine.app.models import ServedModels  # noqa: E402

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def models(tiny_chat_model):
    a = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1)
    b = AsyncLLM(str(tiny_chat_model), max_num_batched_tokens=256, kv_cache_gib=0.05)
    yield ServedModels.of([a, b])
    a.shutdown()
    b.shutdown()


@pytest.fixture(scope="module")
def client(models):
    with TestClient(build_api(models, None, model_name=models.default_id)) as c:
        yield c


def chat(client, model=None, **kw):
    body = {"messages": HELLO, "max_tokens": 2, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return client.post("/v1/chat/completions", json=body)


def generated(engine, at_least: int = 0) -> int:
    """The engine's generated tokens, once its published stats (every 0.2 s, or at rest) show at
    least `at_least`: the reply can reach the client before the engine thread publishes."""
    deadline = time.monotonic() + 2.0
    while (n := engine.stats()["num_generated_tokens"]) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def settled(engine) -> int:
    """The engine's generated tokens once it is at rest and its published stats (every 0.2 s) have
    stopped changing: a count taken while an earlier test's reply is still being published would move."""
    deadline, last = time.monotonic() + 5.0, None
    while time.monotonic() < deadline:
        stats = engine.stats()
        n = stats["num_generated_tokens"]
        if n == last and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return n
        last = n
        time.sleep(0.25)
    return last


def test_v1_models_lists_every_served_model(client, models):
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == models.ids and len(listed) == 2
    tiny = models.ids[1]
    assert client.get(f"/v1/models/{tiny}").json()["id"] == tiny


def test_the_model_field_routes_to_that_engine(client, models):
    default, tiny = models.ids
    before = {mid: generated(e) for mid, e in models.items()}
    r = chat(client, tiny)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == tiny
    assert generated(models[tiny], before[tiny] + 1) > before[tiny] and generated(models[default]) == before[default]
    # its own chat template ("user says"): another prompt length than the default's ChatML
    assert r.json()["usage"]["prompt_tokens"] != chat(client, default).json()["usage"]["prompt_tokens"]


def test_no_model_is_the_default(client, models):
    before = generated(models.default)
    for r in (chat(client), chat(client, "")):
        assert r.status_code == 200 and r.json()["model"] == models.default_id
    assert generated(models.default, before + 1) > before


@pytest.mark.parametrize("name", ["gpt-4", "../etc/passwd", "dummy:tiny", "smollm2-135m-instruct"])
def test_an_unknown_model_is_a_404_naming_the_served(client, models, name):
    before = {mid: settled(e) for mid, e in models.items()}
    r = chat(client, name)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert all(mid in err["message"] for mid in models.ids)
    assert {mid: settled(e) for mid, e in models.items()} == before  # nothing ran
    r = client.get(f"/v1/models/{name}")  # (the client resolves "../" in a path: another route, also 404)
    assert r.status_code == 404 and ("/" in name or models.ids[1] in r.json()["error"]["message"])


def test_a_model_that_is_no_string_is_a_400(client):
    r = chat(client, 7)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_completions_route_too(client, models):
    tiny = models.ids[1]
    r = client.post("/v1/completions", json={"model": tiny, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == tiny
