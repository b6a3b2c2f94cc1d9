"""End to end in headless Chromium: the Admin tab and personas. An admin adds a user who then signs
in; a non-admin sees neither the Engine nor the Admin tab; a public persona made by the admin is
there for another user to pick; a user's private persona is nobody else's. The Admin page's
screenshot goes to $E2E_ARTIFACTS with the others (fixtures from test_browser.py)."""

import re

from playwright.sync_api import expect

from tests.e2e import test_browser
from tests.e2e.test_browser import ARTIFACTS, login, send, set_setting, wait_idle

server, browser_ctx = test_browser.server, test_browser.browser_ctx  # the same fixtures (a server of this module)

PIRATE_PROMPT = "You are a pirate. Answer every question like a pirate would, briefly."


def fill(page, elem_id: str, text: str) -> None:
    page.locator(f"#{elem_id} input, #{elem_id} textarea").first.fill(text)


def signed_in(browser_ctx, url, user, password):
    """A fresh page signed in as `user` (the context's cookies cleared first: one sign-in at a time)."""
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    login(page, url, user, password)
    expect(page.locator("#who")).to_contain_text(f"Signed in as {user}")
    return page


def persona_options(page) -> list[str]:
    """The titles the chat's persona picker offers."""
    page.locator("#persona input").click()
    options = page.get_by_role("option")
    options.first.wait_for()
    titles = [t.replace("✓", "").strip() for t in options.all_inner_texts()]  # ✓ marks the chosen one
    page.keyboard.press("Escape")
    return titles


def test_an_admin_creates_a_user_who_then_logs_in(server, browser_ctx):
    page = signed_in(browser_ctx, server.url, "alice", "pw-alice")
    page.get_by_role("tab", name="Admin").click()
    fill(page, "new-user-name", "carol")
    fill(page, "new-user-password", "pw-carol-123")
    page.locator("#add-user").click()
    expect(page.locator("#users-table")).to_contain_text("carol")
    assert not page.errors, page.errors
    page.close()
    carol = signed_in(browser_ctx, server.url, "carol", "pw-carol-123")
    expect(carol.locator("#msg textarea")).to_be_visible()
    carol.close()


def test_a_non_admin_sees_no_engine_and_no_admin_tab(server, browser_ctx):
    page = signed_in(browser_ctx, server.url, "bob", "pw-bob")
    expect(page.get_by_role("tab", name="Chat")).to_be_visible()
    assert page.get_by_role("tab", name="Engine").count() == 0
    assert page.get_by_role("tab", name="Admin").count() == 0
    assert page.locator("#users-table").count() == 0 or not page.locator("#users-table").is_visible()
    page.close()


def test_an_admins_public_persona_is_there_for_another_user(server, browser_ctx):
    page = signed_in(browser_ctx, server.url, "alice", "pw-alice")
    page.get_by_role("tab", name="Admin").click()
    fill(page, "persona-title", "Pirate")
    fill(page, "persona-description", "Arr, matey")
    fill(page, "persona-prompt", PIRATE_PROMPT)
    page.locator("#persona-save").click()
    expect(page.locator(".toast-body").filter(has_text="public and warmed")).to_be_visible()
    expect(page.locator("#users-table")).to_contain_text("bob")
    page.screenshot(path=str(ARTIFACTS / "08-admin.png"), full_page=True)
    assert not page.errors, page.errors
    page.close()

    bob = signed_in(browser_ctx, server.url, "bob", "pw-bob")
    assert "Pirate" in persona_options(bob)
    picker = bob.locator("#persona input")
    picker.click()
    picker.fill("Pirate")  # typing filters the options; Enter takes the match
    picker.press("Enter")
    expect(picker).to_have_value("Pirate")
    set_setting(bob, "max-tokens", 8)
    send(bob, "Hello!")
    wait_idle(bob)
    expect(bob.locator("#conv-header")).to_contain_text("Pirate")
    bob.close()


def test_a_private_persona_is_not_visible_to_another_user(server, browser_ctx):
    bob = signed_in(browser_ctx, server.url, "bob", "pw-bob")
    bob.locator("#new-persona").get_by_text("New persona").first.click()
    fill(bob, "np-title", "Bob's diary")
    fill(bob, "np-description", "private notes")
    fill(bob, "np-prompt", "You keep Bob's diary and tell no one.")
    bob.locator("#np-create").click()
    expect(bob.locator("#persona input")).to_have_value("Bob's diary")
    assert "Bob's diary" in persona_options(bob)
    assert not bob.errors, bob.errors
    bob.close()

    alice = signed_in(browser_ctx, server.url, "alice", "pw-alice")
    titles = persona_options(alice)
    assert "Assistant" in titles or any(re.search("assist", t, re.I) for t in titles)
    assert "Bob's diary" not in titles
    alice.get_by_role("tab", name="Admin").click()  # nor in the admin's persona editor
    alice.locator("#pick-persona input").click()
    expect(alice.get_by_role("option").first).to_be_visible()
    assert not any("diary" in t for t in alice.get_by_role("option").all_inner_texts())
    alice.close()
