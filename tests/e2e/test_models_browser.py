"""Two models served at once, in a real headless Chromium: the model picker shows, switches the
model of a new chat, the chat's replies come from the picked model (as the stored conversation
says), and a reopened chat shows the model it keeps. Screenshot of the picker in $E2E_ARTIFACTS.
Fixtures and helpers are test_browser.py's (skips as it does without chromium or playwright)."""

import re
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from conftest import save_tiny_chat_model
from test_browser import ARTIFACTS, Server, browser_ctx, expect, login, send, set_setting, wait_idle

__all__ = ["browser_ctx"]  # a fixture of this module too


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return [str(save_tiny_chat_model(root / name, seed)) for seed, name in enumerate(("tiny-a", "tiny-b"))]


@pytest.fixture(scope="module")
def models_server(two_models):
    data = Path(tempfile.mkdtemp(prefix="chatengine-e2e-models-"))
    a, b = two_models
    srv = Server(data, ("--model", a, "--model", b, "--kv-memory-split", "0.7,0.3")).start()
    yield srv
    srv.stop()
    shutil.copy(srv.log.name, ARTIFACTS / "server-models.log") if ARTIFACTS.is_dir() else None
    shutil.rmtree(data, ignore_errors=True)


def stored_models(server) -> dict[str, str]:
    """conversation title -> the model the database says it talks to."""
    with sqlite3.connect(server.data_dir / "chat.db") as db:
        return dict(db.execute("SELECT title, model FROM conversations WHERE user_id = 'alice'").fetchall())


def pick(page, elem_id: str, label: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=label).click()
    expect(page.locator(f"#{elem_id} input")).to_have_value(label)


@pytest.mark.slow  # a server of two models in a browser: left out of CI, run with the whole suite (README)
def test_the_picker_switches_the_model_of_a_new_chat(models_server, two_models, browser_ctx):
    a, b = two_models
    la, lb = "tiny-a", "tiny-b"  # the picker's labels: the directories' names
    page = browser_ctx.new_page()
    login(page, models_server.url, "alice", "pw-alice")
    picker = page.locator("#model input")
    expect(picker).to_be_visible()
    expect(picker).to_have_value(la)  # the default: the first --model
    set_setting(page, "max-tokens", 6)
    picker.click()
    expect(page.get_by_role("option", name=lb)).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "models-01-picker.png"))
    page.get_by_role("option", name=lb).click()
    expect(picker).to_have_value(lb)

    send(page, "Hello from the second model")
    wait_idle(page)
    assert stored_models(models_server)["Hello from the second model"] == b
    expect(picker).to_have_value(lb)
    expect(picker).to_be_disabled()  # an open chat keeps its model
    page.screenshot(path=str(ARTIFACTS / "models-02-chat-on-b.png"))

    page.locator("#new-chat").click()
    expect(picker).to_be_enabled()
    pick(page, "model", la)
    send(page, "Hello from the first model")
    wait_idle(page)
    assert stored_models(models_server)["Hello from the first model"] == a

    # reopen the first chat: it shows its own model, and its next reply is that model's
    page.locator("#conv-list").get_by_text("Hello from the second model").click()
    expect(picker).to_have_value(lb)
    expect(picker).to_be_disabled()
    send(page, "And once more")
    wait_idle(page)
    assert stored_models(models_server)["Hello from the second model"] == b

    # the Engine tab shows each model's own pool, split 0.7 / 0.3 of --kv-cache-gib
    page.get_by_role("tab", name="Engine").click()
    view = page.locator("#kv-view")
    expect(view).to_contain_text(f"{a} on cpu")
    total_a = device_pages(view)
    pick(page, "engine-model", lb)
    expect(view).to_contain_text(f"{b} on cpu")
    total_b = device_pages(view)
    assert abs(total_a / total_b - 0.7 / 0.3) < 0.01, (total_a, total_b)
    page.screenshot(path=str(ARTIFACTS / "models-03-engine-tab.png"), full_page=True)
    page.close()


def device_pages(view) -> int:
    """The device pool's size in the Engine tab's picture ("Device pages  used/total")."""
    return int(re.search(r"Device pages\s*\d+/(\d+)", view.inner_text()).group(1))
