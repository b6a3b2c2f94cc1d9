"""End to end in a real headless Chromium (Debian's `chromium`, driven by Playwright through
executable_path; never `playwright install`): log in, chat, see the reply stream, switch
alternatives, edit and fork, stop, HTML stays inert, a second user sees nothing, and a SIGKILL
mid-reply loses no finished message. The Admin tab and personas (at the end, on the same server:
each server start costs ~20 s of CI's two cores): an admin adds a user who then signs in; a
non-admin sees neither the Engine nor the Admin tab; a public persona made by the admin is there
for another user to pick; a user's private persona is nobody else's. Screenshots (the Admin
page's is 08-admin.png) go to $E2E_ARTIFACTS (default /tmp/chatengine-e2e). Skips cleanly
without chromium or playwright."""

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = next(
    (
        p
        for p in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or "")
        if p and os.path.exists(p)
    ),
    None,
)
if CHROMIUM is None:
    pytest.skip("chromium is not installed (apt-get install -y chromium)", allow_module_level=True)
pytest.importorskip("chatengine.app.auth", reason="login needs chatengine.app.auth")

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from chatengine.app.auth import hash_password  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("E2E_ARTIFACTS", "/tmp/chatengine-e2e"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# the passwords stored hashed with few PBKDF2 iterations, as the unit tests do: each sign-in checks
# one on the server, and at the default 600k each cost ~0.35 s of CPU (test_auth.py covers the default)
FAST = 1000
USERS = {
    "alice": {"password": hash_password("pw-alice", iterations=FAST), "api_key": "sk-alice", "admin": True},
    "bob": {"password": hash_password("pw-bob", iterations=FAST), "api_key": "sk-bob"},
}
LONG_PROMPT = "Write a very long story about a dragon, at least 1000 words."
KNIGHT_PROMPT = "Write a very long story about a knight, at least 1000 words."
# long replies (a story, not one sentence), so the three streams are still running when looked for
PLANETS = "Write a long story about a journey past every planet."
T = 60_000  # ms: generous on 2 shared cores
expect.set_options(timeout=T)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, data_dir: Path, args: tuple[str, ...] = ()):
        self.data_dir, self.port, self.args = data_dir, free_port(), args  # args: more flags of app.py
        self.url = f"http://127.0.0.1:{self.port}/"
        self.proc = None
        self.retries = 0  # starts again on another port when the chosen one was taken meanwhile

    def start(self):
        users = self.data_dir / "users.json"
        users.write_text(json.dumps(USERS))
        self.log = open(self.data_dir / f"server-{time.time():.0f}.log", "w")
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "app.py",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--users",
                str(users),
                "--kv-cache-gib",
                "0.25",
                "--max-num-batched-tokens",
                "512",
                "--log-level",
                "warning",
                *self.args,
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                said = (self.data_dir / self.log.name).read_text()
                if "address already in use" in said.lower() and self.retries < 3:  # taken while it loaded
                    self.port, self.retries = free_port(), self.retries + 1
                    self.url = f"http://127.0.0.1:{self.port}/"
                    self.log.close()
                    return self.start()
                raise AssertionError(f"server exited: {said[-2000:]}")
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.25)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=15)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server():
    data = Path(tempfile.mkdtemp(prefix="chatengine-e2e-"))
    srv = Server(data).start()
    yield srv
    srv.stop()
    shutil.copy(srv.log.name, ARTIFACTS / "server.log") if ARTIFACTS.is_dir() else None
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="module")
def browser_ctx():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1360, "height": 900},
        )
        ctx.set_default_timeout(T)
        yield ctx
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def chat_page(browser_ctx):
    page = browser_ctx.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    return page


def stored(server, query: str, *args):
    """The first column of the first row `query` finds in the server's chat store (None if none)."""
    db = sqlite3.connect(server.data_dir / "chat.db", timeout=10)
    try:
        row = db.execute(query, args).fetchone()
    finally:
        db.close()
    return row[0] if row else None


def login(page, url, user, password):
    page.context.clear_cookies()  # whoever a test before left signed in (a failed one too)
    page.goto(url)
    page.get_by_label("username").fill(user)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()
    page.locator("#msg textarea").wait_for()


def send(page, text):
    box = page.locator("#msg textarea")
    box.fill(text)
    box.press("Enter")


def reply(page, text):
    """Send and wait for this turn's reply to be final: its own bubble first (the chat's last bubble
    until it comes is the previous reply, already final, and a wait on it alone would pass at once
    while this turn's updates, the sidebar's included, are still to arrive)."""
    before = page.locator('#chat [data-testid="bot"]').count()
    send(page, text)
    expect(page.locator('#chat [data-testid="bot"]').nth(before)).to_be_attached()
    wait_idle(page)


def last_bot(page):
    return page.locator('#chat [data-testid="bot"]').last


def wait_idle(page):
    """Until the last reply is final. Its stats line ("N tokens · TTFT ...") comes only with the
    final render: after an edit the browser shows an empty reply before the server has even
    started (and #send is still visible then), so the cursor and the buttons alone can pass early."""
    expect(last_bot(page)).to_contain_text(re.compile(r"\d+ tokens? · TTFT"))
    expect(last_bot(page)).not_to_contain_text("▍")
    expect(page.locator("#send")).to_be_visible()


def set_setting(page, elem_id, value):
    acc = page.locator("#settings")
    box = page.locator(f"#{elem_id} input[type=number]")
    if not box.is_visible():
        acc.get_by_text("Generation settings").first.click()
    slider = page.locator(f"#{elem_id} input[type=range]")
    for attempt in range(3):
        box.fill(str(value))
        box.press("Enter")
        if not slider.count():
            return
        try:  # the value the next event sends (the page starts at the server's default)
            expect(slider).to_have_value(str(value), timeout=10_000)
            return
        except AssertionError:  # a page event still loading set the default over it: again
            if attempt == 2:
                raise


def test_chat_stream_alternatives_edit_stop(server, chat_page):
    page = chat_page
    login(page, server.url, "alice", "pw-alice")
    set_setting(page, "max-tokens", 160)  # long enough to see it stream (24 tokens took 0.2 s here)
    send(page, "Tell me about the moon.")
    # the reply streams: the cursor shows while tokens arrive, then the stats line
    expect(page.locator("#chat")).to_contain_text("Tell me about the moon.")
    expect(last_bot(page)).to_contain_text("▍")
    wait_idle(page)
    expect(last_bot(page)).to_contain_text("tokens")
    expect(last_bot(page)).to_contain_text("TTFT")
    expect(page.locator("#conv-list")).to_contain_text("Tell me about the moon.")
    page.screenshot(path=str(ARTIFACTS / "01-reply.png"))
    set_setting(page, "max-tokens", 24)

    # regenerate -> alternative 2/2, stepped in place by the reply's own ‹ 2/2 ›
    first_reply = last_bot(page).inner_text()
    page.locator("#regenerate").click()
    expect(page.locator("#alt-label")).to_contain_text("2 / 2")
    wait_idle(page)
    expect(last_bot(page).locator(".ver-count")).to_have_text("2/2")
    expect(last_bot(page).locator(".ver-next.ver-on")).to_have_count(0)  # no › past the last
    last_bot(page).locator(".ver-prev.ver-on").click()
    expect(last_bot(page).locator(".ver-count")).to_have_text("1/2")
    expect(last_bot(page)).to_contain_text(first_reply.split("\n")[0][:20])
    last_bot(page).locator(".ver-next.ver-on").click()
    expect(last_bot(page).locator(".ver-count")).to_have_text("2/2")
    page.screenshot(path=str(ARTIFACTS / "02-alternatives.png"))

    # n = 3 alternatives in one request: all three stream side by side, then one shows with ‹ 1/3 ›
    set_setting(page, "n", 3)
    set_setting(page, "max-tokens", 160)  # long enough to see the three streams
    send(page, PLANETS)
    expect(page.locator("#chat")).to_contain_text("3/3 · generating…", timeout=T)
    wait_idle(page)
    set_setting(page, "max-tokens", 24)
    expect(last_bot(page).locator(".ver-count")).to_have_text("1/3")
    last_bot(page).locator(".ver-next.ver-on").click()
    expect(last_bot(page).locator(".ver-count")).to_have_text("2/3")
    set_setting(page, "n", 1)

    # edit the first user message -> a fork with its own reply; the old branch survives
    page.locator('#chat [data-testid="user"]').first.click()
    page.locator('#chat button[aria-label="Edit"]').first.click()
    page.locator("#chat textarea").fill("Tell me about the sun.")
    page.locator("#chat").get_by_role("button", name="Submit").click()
    expect(page.locator("#chat")).to_contain_text("Tell me about the sun.")
    expect(page.locator("#chat")).not_to_contain_text(PLANETS)
    # the edited message carries its own ‹ 2/2 ›; ‹ brings back the old branch
    first_user = page.locator('#chat [data-testid="user"]').first
    expect(first_user.locator(".ver-count")).to_have_text("2/2")
    # once the fork's reply is final: the edited page still shows the old last reply (final) until
    # the server's first render of the fork, so a wait before that could pass while the fork's reply
    # then streamed, and a streaming reply refuses ‹ (it owns the view)
    wait_idle(page)
    first_user.locator(".ver-prev.ver-on").click()
    expect(page.locator("#chat")).to_contain_text(PLANETS)
    expect(page.locator('#chat [data-testid="user"]').first.locator(".ver-count")).to_have_text("1/2")
    page.screenshot(path=str(ARTIFACTS / "02b-versions-inline.png"))

    # stop: the partial reply stays, marked stopped (a new chat; greedy, this prompt runs to
    # max tokens)
    page.locator("#new-chat").click()
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0)
    set_setting(page, "temperature", 0)
    set_setting(page, "max-tokens", 3000)  # stopped long before its end, on a fast machine too
    send(page, KNIGHT_PROMPT)
    expect(page.locator("#stop")).to_be_visible()
    expect(last_bot(page)).to_contain_text("▍")
    time.sleep(0.5)
    page.locator("#stop").click()
    expect(page.locator("#send")).to_be_visible()
    expect(last_bot(page)).to_contain_text("stopped")
    page.screenshot(path=str(ARTIFACTS / "03-stopped.png"))

    # HTML and script in a message are shown as text and never run
    set_setting(page, "temperature", 0.7)
    set_setting(page, "max-tokens", 4)
    send(
        page,
        'look <img src=x onerror="window.__xss=1"> <script>window.__xss=2</script> <b>bold</b> '
        "[link](javascript:window.__xss=3)",
    )
    user_msg = page.locator('#chat [data-testid="user"]').last
    expect(user_msg).to_contain_text("<img src=x")
    wait_idle(page)
    expect(user_msg).to_contain_text("<b>bold</b>")
    assert page.evaluate("window.__xss") is None
    assert page.locator("#chat img[src='x']").count() == 0
    assert page.locator("#chat a[href^='javascript']").count() == 0

    # the Engine tab (alice is an admin) draws the KV pages and the plots
    page.get_by_role("tab", name="Engine").click()
    expect(page.locator("#kv-view")).to_contain_text("device pages")
    time.sleep(2.5)
    page.screenshot(path=str(ARTIFACTS / "04-engine.png"), full_page=True)
    page.get_by_role("tab", name="Chat").click()
    assert not page.errors, page.errors


def test_second_user_sees_nothing(server, chat_page, browser_ctx):
    page = chat_page
    browser_ctx.clear_cookies()
    login(page, server.url, "bob", "pw-bob")
    expect(page.locator("#conv-list")).not_to_contain_text("moon")
    expect(page.locator("#conv-list")).not_to_contain_text("sun")
    page.locator("#search input, #search textarea").first.fill("moon")
    time.sleep(0.5)
    assert page.locator("#conv-list label").count() == 0
    expect(page.get_by_role("tab", name="Chat")).to_be_visible()
    assert page.get_by_role("tab", name="Engine").count() == 0  # server-wide figures: admins only
    page.screenshot(path=str(ARTIFACTS / "05-bob.png"))
    browser_ctx.clear_cookies()


def test_html_and_images_in_a_message_are_shown_never_loaded(server, browser_ctx):
    """A message's HTML shows as text, past a stray backtick and a blank line too, and a markdown
    image shows as a link: nothing in a message makes the browser fetch a URL on its own."""
    page = signed_in(browser_ctx, server.url, "bob", "pw-bob")
    fetched = []
    page.on("request", lambda r: fetched.append(r.url) if "elsewhere.invalid" in r.url else None)
    send(
        page,
        "See ![status](http://elsewhere.invalid/x.png?q=secret) and `a\n\n<img src=http://elsewhere.invalid/y.png>\n\n`",
    )
    mine = page.locator('#chat [data-testid="user"]').last
    expect(mine).to_contain_text("<img src=http://elsewhere.invalid/y.png>")
    expect(mine.locator("a[href*='elsewhere.invalid/x.png']")).to_have_count(1)
    assert mine.locator("img").count() == 0
    page.locator("#stop").click()
    expect(page.locator("#send")).to_be_visible()
    assert fetched == [] and page.errors == []
    browser_ctx.clear_cookies()


POEM_PROMPT = "Write a very long poem about the sea, at least 1000 words."


def open_chat(page, title):
    page.locator("#conv-list label", has_text=title).first.click()


def test_a_reply_outlives_its_tab_and_follows_the_open_chat(server, chat_page, browser_ctx):
    """The reply belongs to the server, Send / Stop to the chat on screen: the tab that sent it opens
    a new chat (Send shows, a message there is answered and Continue writes more of its reply), a
    second tab opens the chat and sees it live, the first tab reloads and finds it still growing;
    the second tab's Stop (a tab that did not send it) ends it, and both show it stopped."""
    page = chat_page
    login(page, server.url, "alice", "pw-alice")
    set_setting(page, "temperature", 0)
    # greedy, this prompt runs to max tokens (no end within 4000): 3000 keep it writing through
    # every step below until tab 2's Stop (640 ended before that click once, ~8 s after the send)
    set_setting(page, "max-tokens", 3000)
    send(page, POEM_PROMPT)
    expect(last_bot(page)).to_contain_text("▍")
    expect(page.locator("#stop")).to_be_visible()
    t0 = time.monotonic()

    page.locator("#new-chat").click()  # another chat while the poem is written
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    set_setting(page, "max-tokens", 4)
    send(page, "Say hi.")
    wait_idle(page)
    expect(last_bot(page)).to_contain_text("cut at max tokens")  # greedy: longer than 4 tokens
    page.locator("#continue").click()  # 4 more, into the same reply
    expect(last_bot(page)).to_contain_text("8 tokens")
    wait_idle(page)
    expect(page.locator('#chat [data-testid="bot"]')).to_have_count(1)

    tab2 = browser_ctx.new_page()
    tab2.goto(server.url)
    open_chat(tab2, "Write a very long poem")
    expect(last_bot(tab2)).to_contain_text("▍")  # live, from where it is
    expect(tab2.locator("#stop")).to_be_visible()

    page.reload()
    open_chat(page, "Write a very long poem")
    expect(last_bot(page)).to_contain_text("▍")
    grown = "n => document.querySelector('#chat').innerText.length > n"
    page.wait_for_function(grown, arg=len(page.locator("#chat").inner_text()))
    print(f"still growing {time.monotonic() - t0:.1f} s after the send")
    page.screenshot(path=str(ARTIFACTS / "05b-after-reload.png"))
    tab2.locator("#stop").click()  # not the tab that sent it: Stop follows the chat on screen
    for p in (page, tab2):
        wait_idle(p)
        expect(last_bot(p)).to_contain_text("stopped")
    print(f"stopped {time.monotonic() - t0:.1f} s after the send")
    tab2.close()
    browser_ctx.clear_cookies()


@pytest.mark.slow  # restarts or loads a whole server: left out of CI, run with the whole suite (README)
def test_reload_and_sigkill_mid_reply(server, chat_page, browser_ctx):
    page = chat_page
    login(page, server.url, "alice", "pw-alice")
    # the conversation is there after a reload
    page.locator("#conv-list label", has_text="Tell me about the").first.click()
    expect(page.locator("#chat")).to_contain_text("Tell me about the")
    # a reply in progress when the server is SIGKILLed (a new chat, greedy: this prompt runs
    # to max tokens)
    page.locator("#new-chat").click()
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0)
    set_setting(page, "temperature", 0)
    set_setting(page, "max-tokens", 3000)  # still writing when the server dies, on a fast machine too
    send(page, LONG_PROMPT)
    expect(last_bot(page)).to_contain_text("▍")
    time.sleep(1.5)  # a partial save happens every second
    server.kill()
    # the page says so in words; the reply on screen is marked; Stop (which cannot reach it) goes
    expect(page.locator("#conn-banner")).to_contain_text("Connection to the server lost")
    expect(last_bot(page)).to_contain_text("connection lost")
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("#alt-label")).not_to_contain_text("Generating")
    page.screenshot(path=str(ARTIFACTS / "06a-connection-lost.png"))
    page.goto("about:blank")
    page.close()
    db = sqlite3.connect(server.data_dir / "chat.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = db.execute("SELECT status, content FROM messages WHERE role = 'assistant'").fetchall()
    finally:
        db.close()
    statuses = [r[0] for r in rows]
    assert statuses.count("streaming") == 1, rows  # only the reply being written...
    assert [r[1] for r in rows if r[0] == "streaming"][0]  # ...with its partial text saved
    assert statuses.count("done") >= 4, statuses  # every finished reply survived
    server.start()
    page = browser_ctx.new_page()
    page.goto(server.url)  # the sign-in outlives the restart: straight to the chats
    page.locator("#msg textarea").wait_for()
    expect(page.locator("#conv-list")).to_contain_text("Tell me about the")
    page.locator("#conv-list label", has_text="Write a very long story").first.click()
    expect(last_bot(page)).to_contain_text("interrupted")
    # and the conversation goes on
    set_setting(page, "max-tokens", 4)
    send(page, "Are you back?")
    expect(page.locator("#chat")).to_contain_text("Are you back?")
    wait_idle(page)
    expect(last_bot(page)).to_contain_text("tokens")
    page.screenshot(path=str(ARTIFACTS / "06-after-restart.png"))


def test_a_failed_sign_in_keeps_the_name_and_says_why(server, browser_ctx):
    """A wrong password empties only the password; past the throttle's limit the page says how
    long to wait (Gradio's own page emptied both fields and showed nothing on a 429)."""
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(server.url)
    for attempt in range(6):  # "carol" does not exist: her failures count against her name only
        if attempt == 0:
            page.get_by_label("username").fill("carol")
        page.get_by_label("password").fill(f"guess-{attempt}")
        page.get_by_role("button", name="Login").click()
        if attempt < 5:
            expect(page.locator("#error")).to_have_text("Wrong username or password.")
            page.locator("#error").evaluate("e => e.textContent = ''")
    expect(page.locator("#error")).to_contain_text("Too many failed sign-ins: try again in")
    assert page.get_by_label("username").input_value() == "carol"
    assert page.get_by_label("password").input_value() == ""
    page.screenshot(path=str(ARTIFACTS / "07-sign-in-throttled.png"))
    login(page, server.url, "alice", "pw-alice")  # another name still signs in
    assert not page.errors, page.errors


def test_log_out_in_place_then_a_wrong_password_then_the_right_one(server, browser_ctx):
    """Log out leaves this tab on the sign-in page (no new tab); a wrong password keeps the name and
    says so; the next try in the same page signs in."""
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    login(page, server.url, "bob", "pw-bob")
    expect(page.locator("#who")).to_contain_text("Signed in as bob")
    tabs = len(browser_ctx.pages)
    page.locator("#logout").click()
    expect(page.get_by_label("username")).to_be_visible()
    assert len(browser_ctx.pages) == tabs
    page.get_by_label("username").fill("bob")
    page.get_by_label("password").fill("not-bob's")
    page.get_by_role("button", name="Login").click()
    expect(page.locator("#error")).to_have_text("Wrong username or password.")
    assert page.get_by_label("username").input_value() == "bob"
    page.get_by_label("password").fill("pw-bob")
    page.get_by_role("button", name="Login").click()
    expect(page.locator("#who")).to_contain_text("Signed in as bob")
    page.close()


# ---- #17: links, settings that stay, sign-ins that outlive a restart, the chat menu, phones ----


def url_cid(page) -> str | None:
    m = re.search(r"[?&]c=([^&#]+)", page.url)
    return m.group(1) if m else None


def settings_shown(page) -> dict:
    names = ("temperature", "top-p", "max-tokens", "seed", "n")
    acc = page.locator("#settings")
    if not page.locator("#seed input[type=number]").is_visible():
        acc.get_by_text("Generation settings").first.click()
    return {n: page.locator(f"#{n} input[type=number]").input_value() for n in names}


def test_a_chat_link_reopens_it_with_its_settings_and_is_nothing_to_others(server, browser_ctx):
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    login(page, server.url, "alice", "pw-alice")
    expect(page.locator("#who")).to_contain_text("Signed in as alice")  # the page's load events are done
    page.locator("#new-chat").click()
    assert url_cid(page) is None
    for elem_id, value in (("temperature", 0.35), ("top-p", 0.8), ("max-tokens", 5), ("seed", 123)):
        set_setting(page, elem_id, value)
    send(page, "Name a colour, please.")
    wait_idle(page)
    page.wait_for_function("() => new URLSearchParams(location.search).get('c')")
    cid = url_cid(page)
    link = page.url
    page.goto(server.url)  # the plain address: defaults, no chat open
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0)
    page.goto(link)  # the link (as a reload would): the chat and its settings
    expect(page.locator("#chat")).to_contain_text("Name a colour, please.")
    settings_shown(page)  # opens the settings
    expect(page.locator("#seed input[type=number]")).to_have_value("123")
    assert settings_shown(page) == {"temperature": "0.35", "top-p": "0.8", "max-tokens": "5", "seed": "123", "n": "1"}
    set_setting(page, "max-tokens", 9)  # changed by hand, nothing sent: kept with the chat too
    saved_max_tokens = "SELECT json_extract(settings, '$.max_tokens') FROM conversations WHERE id = ?"
    deadline = time.monotonic() + T / 1000
    while stored(server, saved_max_tokens, cid) != 9:  # the save is its own event: on disk before the reload
        assert time.monotonic() < deadline, "the changed setting was never saved"
        time.sleep(0.1)
    page.reload()
    expect(page.locator("#chat")).to_contain_text("Name a colour, please.")
    page.wait_for_function("() => new URLSearchParams(location.search).get('c')")  # set once it opens
    assert url_cid(page) == cid
    settings_shown(page)
    expect(page.locator("#max-tokens input[type=number]")).to_have_value("9")
    expect(page.locator("#seed input[type=number]")).to_have_value("123")
    page.screenshot(path=str(ARTIFACTS / "09-chat-link.png"))

    browser_ctx.clear_cookies()  # bob follows alice's link: nothing of it, and "not found" in words
    login(page, link, "bob", "pw-bob")
    expect(page.locator(".toast-body")).to_contain_text("not found")
    expect(page.locator("#chat")).not_to_contain_text("Name a colour")
    expect(page.locator("#conv-list")).not_to_contain_text("Name a colour")
    page.wait_for_function("() => !new URLSearchParams(location.search).get('c')")
    page.screenshot(path=str(ARTIFACTS / "10-link-not-yours.png"))
    page.close()
    browser_ctx.clear_cookies()


@pytest.mark.slow  # restarts the server: left out of CI, run with the whole suite (README)
def test_a_restart_keeps_the_sign_in_and_logout_ends_the_cookie(server, browser_ctx):
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    login(page, server.url, "alice", "pw-alice")
    expect(page.locator("#who")).to_contain_text("Signed in as alice")
    [cookie] = [c for c in browser_ctx.cookies() if c["name"] == "chatengine-session"]
    assert cookie["httpOnly"] and cookie["value"] not in (server.data_dir / "chat.db").read_bytes().decode("latin-1")
    server.stop()
    server.start()
    page.goto(server.url)  # (its address, should the restart have moved it to another port)
    expect(page.locator("#who")).to_contain_text("Signed in as alice")  # no sign-in page
    expect(page.locator("#conv-list")).to_contain_text("Name a colour")

    def with_old_cookie(path: str) -> tuple[int, str]:
        req = urllib.request.Request(server.url + path, headers={"Cookie": f"chatengine-session={cookie['value']}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert "signin" not in with_old_cookie("")[1]  # the app itself, not the sign-in page
    page.locator("#logout").click()
    expect(page.get_by_label("username")).to_be_visible()
    status, body = with_old_cookie("")
    assert status == 200 and 'id="signin"' in body  # the old cookie signs in no one now
    assert with_old_cookie("config")[0] in (401, 403)
    browser_ctx.add_cookies([{k: cookie[k] for k in ("name", "value", "domain", "path")}])
    page.goto(server.url)
    expect(page.get_by_label("username")).to_be_visible()
    page.close()


def test_the_chat_menu_renames_pins_exports_and_deletes_after_a_confirm(server, browser_ctx):
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    login(page, server.url, "alice", "pw-alice")
    page.locator("#new-chat").click()
    set_setting(page, "max-tokens", 4)
    reply(page, "Say something short.")
    reply(page, "And again.")
    page.locator("#chat-menu-btn").click()
    expect(page.locator("#rename-box textarea, #rename-box input").first).to_have_value("Say something short.")
    box = page.locator("#rename-box textarea, #rename-box input").first
    box.fill("Short sayings")
    box.press("Enter")
    expect(page.locator("#conv-list")).to_contain_text("Short sayings")
    page.locator("#pin").click()
    expect(page.locator("#pin")).to_have_text("Unpin")
    labels = page.locator("#conv-list label")
    expect(labels.nth(0)).to_contain_text("Pinned")
    expect(labels.nth(1)).to_have_text("Short sayings")
    page.screenshot(path=str(ARTIFACTS / "11-chat-menu.png"))

    with page.expect_download() as md:
        page.locator("#export-md").click()
    text = Path(md.value.path()).read_text()
    assert md.value.suggested_filename == "Short-sayings.md"
    assert text.startswith("# Short sayings") and "**You:**\n\nAnd again." in text
    with page.expect_download() as js:
        page.locator("#export-json").click()
    data = json.loads(Path(js.value.path()).read_text())
    assert data["conversation"]["title"] == "Short sayings" and data["conversation"]["pinned"] is True
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant", "user", "assistant"]

    page.locator("#pin").click()  # unpin: back under its date
    expect(labels.nth(0)).to_contain_text("Today")
    page.locator("#delete").click()
    expect(page.locator("#confirm-delete")).to_be_visible()
    page.locator("#cancel-delete").click()
    expect(page.locator("#confirm-delete")).to_be_hidden()
    expect(page.locator("#conv-list")).to_contain_text("Short sayings")  # Cancel keeps it
    page.locator("#delete").click()
    page.locator("#confirm-delete").click()
    expect(page.locator("#conv-list")).not_to_contain_text("Short sayings")
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0)
    page.wait_for_function("() => !new URLSearchParams(location.search).get('c')")
    page.close()


def test_at_phone_width_the_sidebar_leaves_the_chat_in_sight_and_closes_after_a_pick(server, browser_ctx):
    browser_ctx.clear_cookies()
    page = browser_ctx.new_page()
    page.set_viewport_size({"width": 390, "height": 844})
    login(page, server.url, "alice", "pw-alice")
    sidebar = page.locator("#sidebar")
    expect(sidebar).not_to_have_class(re.compile(r"\bopen\b"))  # closed when the page opens
    page.locator("#sidebar .toggle-button").click()
    expect(sidebar).to_have_class(re.compile(r"\bopen\b"))
    page.wait_for_timeout(500)  # the slide-in
    box = sidebar.bounding_box()
    assert box["x"] >= -1 and box["x"] + box["width"] <= 0.9 * 390, box  # the chat stays in sight
    page.screenshot(path=str(ARTIFACTS / "12-phone-sidebar-open.png"))
    page.locator("#conv-list label", has_text="Name a colour").first.click()
    expect(sidebar).not_to_have_class(re.compile(r"\bopen\b"))
    expect(page.locator("#chat")).to_contain_text("Name a colour, please.")
    page.wait_for_timeout(500)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
    page.screenshot(path=str(ARTIFACTS / "13-phone-chat-picked.png"))
    page.close()


# ---- the Admin tab and personas: after the tests above (which know only alice and bob), on their
# server; the admin adds erin (carol's name is throttled by the failed sign-ins above)

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
    fill(page, "new-user-name", "erin")
    fill(page, "new-user-password", "pw-erin-123")
    page.locator("#add-user").click()
    expect(page.locator("#users-table")).to_contain_text("erin")
    assert not page.errors, page.errors
    page.close()
    erin = signed_in(browser_ctx, server.url, "erin", "pw-erin-123")
    expect(erin.locator("#msg textarea")).to_be_visible()
    erin.close()


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
