"""Drive Open WebUI (its defaults untouched) against our server in headless Chromium; see
scripts/compat_openwebui.sh, which makes the venv and calls this.

Our server runs with an API key; Open WebUI is pointed at its /v1 with that key (single-user mode,
no Ollama, offline). In the browser: pick our model, send a message, wait for the streamed answer,
send a second turn, regenerate the last answer. Every request Open WebUI made to our server and its
status are read from our access log; any 4xx/5xx fails the run. The run (versions, requests,
statuses, what the model answered) is saved as JSON and markdown under --out, screenshots under
--artifacts.
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import commit  # noqa: E402

KEY = "sk-compat-openwebui"
ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|OPTIONS|HEAD|PATCH) (\S+) HTTP/[\d.]+" (\d{3})')
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
T = 240_000  # ms: a reply of a few hundred tokens on 2 shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")


def start_ours(work: Path, port: int, log) -> subprocess.Popen:
    users = work / "users.json"
    users.write_text(json.dumps({"owui": {"password": "pw-compat-openwebui", "api_key": KEY}}))
    users.chmod(0o600)
    cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--users", str(users)]
    cmd += ["--data-dir", str(work / "ours"), "--no-disk-kv"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def start_open_webui(binary: str, work: Path, port: int, ours: int, log) -> subprocess.Popen:
    env = {
        **os.environ,
        "DATA_DIR": str(work / "open-webui"),
        "WEBUI_AUTH": "False",  # single-user mode: no sign-up page to drive
        "WEBUI_SECRET_KEY": "compat",
        "ENABLE_OLLAMA_API": "False",
        "OPENAI_API_BASE_URL": f"http://127.0.0.1:{ours}/v1",
        "OPENAI_API_KEY": KEY,
        "OFFLINE_MODE": "True",  # no model hub, no version check
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
        "ENABLE_VERSION_UPDATE_CHECK": "False",
        "ANONYMIZED_TELEMETRY": "False",
        "DO_NOT_TRACK": "True",
        "SCARF_NO_ANALYTICS": "True",
    }
    cmd = [binary, "serve", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)


def version_of(binary: str) -> str:
    python = Path(binary).with_name("python")
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('open-webui'))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "unknown"


def answers(page) -> list[str]:
    """The assistant messages' texts, in order."""
    return [t.strip() for t in page.locator("#response-content-container").all_inner_texts()]


def send(page, text: str) -> None:
    box = page.locator("#chat-input")
    box.click()
    page.keyboard.type(text)
    page.keyboard.press("Enter")


def regenerate_buttons(page):
    """The Regenerate action under each finished assistant message."""
    return page.get_by_role("button", name="Regenerate", exact=True)


def wait_reply(page, count: int, shots: Path, name: str, version: str | None = None) -> str:
    """Until `count` assistant messages exist and the last one is done: its action buttons show and
    its text stopped growing. (Open WebUI's Stop button stays while its background tasks, follow-up
    questions and a title, still generate: those are not the reply.) `version`: a regenerated
    reply's "2/2" marker to wait for first."""
    from playwright.sync_api import expect

    expect(page.locator("#response-content-container")).to_have_count(count, timeout=T)
    if version is not None:
        expect(page.get_by_text(version, exact=True).first).to_be_visible(timeout=T)
    expect(regenerate_buttons(page).last).to_be_visible(timeout=T)
    end, last, same = time.monotonic() + T / 1000, None, 0
    while same < 3 and time.monotonic() < end:  # the text unchanged for 3 s
        text = answers(page)[count - 1]
        same = same + 1 if text and text == last else 0
        last = text
        page.wait_for_timeout(1000)
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    if not last:
        raise RuntimeError(f"{name}: the assistant message is empty")
    return last


def wait_background(page, timeout_ms: int) -> bool:
    """Wait for Open WebUI's background tasks (its Stop button goes); False if they still run."""
    try:
        page.locator("button[aria-label='Stop'], button#stop-response-button").first.wait_for(
            state="detached", timeout=timeout_ms
        )
        return True
    except Exception:
        return False


def pick_model(page, model: str) -> None:
    """Make sure our model is the chat's model (Open WebUI preselects it when it is the only one)."""
    name = model.rsplit("/", 1)[-1]
    if page.get_by_text(name, exact=False).count():
        return
    page.get_by_role("button", name=re.compile("select a model", re.I)).first.click()
    page.get_by_role("button", name=re.compile(re.escape(name), re.I)).first.click()


def drive(url: str, model: str, shots: Path) -> tuple[dict, bool]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(60_000)
        try:
            page.goto(url)
            page.wait_for_selector("#chat-input", timeout=120_000)
            page.keyboard.press("Escape")  # a "what's new" dialog on first start
            page.screenshot(path=str(shots / "0-start.png"), full_page=True)
            pick_model(page, model)
            send(page, "What is the capital of France? Answer in one sentence.")
            first = wait_reply(page, 1, shots, "1-first-answer")
            send(page, "And of Italy?")
            second = wait_reply(page, 2, shots, "2-second-turn")
            page.locator("#response-content-container").nth(1).hover()
            regenerate_buttons(page).last.click()  # a menu: a suggestion box, Try Again, Add Details, ...
            page.get_by_role("button", name="Try Again", exact=True).click()
            regenerated = wait_reply(page, 2, shots, "3-regenerated", version="2/2")
            settled = wait_background(page, T)
        except Exception:
            page.screenshot(path=str(shots / "failed.png"), full_page=True)
            (shots / "failed.txt").write_text(page.inner_text("body"))
            raise
        finally:
            browser.close()
    return {"first": first, "second": second, "regenerated": regenerated}, settled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--open-webui", required=True, help="the open-webui executable of its venv")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--artifacts", default="/tmp/chatengine-openwebui")
    args = ap.parse_args()
    shots = Path(args.artifacts)
    shots.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="owui-compat-"))
    ours_port, owui_port = free_port(), free_port()
    ours_log, owui_log = open(shots / "ours.log", "w"), open(shots / "open-webui.log", "w")
    ours = start_ours(work, ours_port, ours_log)
    owui = None
    run: dict = {
        "open_webui": version_of(args.open_webui),
        "chatengine_commit": commit(),
        "chromium": subprocess.run(["chromium", "--version"], capture_output=True, text=True).stdout.strip(),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        wait_http(f"http://127.0.0.1:{ours_port}/health", ours, 300, "our server")
        with urllib.request.urlopen(
            urllib.request.Request(
                f"http://127.0.0.1:{ours_port}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
            )
        ) as r:
            model = json.load(r)["data"][0]["id"]
        owui = start_open_webui(args.open_webui, work, owui_port, ours_port, owui_log)
        wait_http(f"http://127.0.0.1:{owui_port}/health", owui, 600, "Open WebUI")
        run["model"] = model
        run["replies"], run["background_tasks_finished"] = drive(f"http://127.0.0.1:{owui_port}/", model, shots)
    except Exception as e:
        run["error"] = f"{type(e).__name__}: {e}"
    finally:
        for proc in (owui, ours):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        ours_log.close()
        owui_log.close()
        shutil.rmtree(work, ignore_errors=True)
    requests = [m.groups() for m in ACCESS.finditer((shots / "ours.log").read_text()) if m.group(2).startswith("/v1")]
    run["requests"] = [{"method": m, "path": p, "status": int(s)} for m, p, s in requests]
    bad = [r for r in run["requests"] if r["status"] >= 400]
    run["passed"] = "error" not in run and not bad and any(r["path"] == "/v1/chat/completions" for r in run["requests"])
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"compat_openwebui-{stamp}.json").write_text(json.dumps(run, indent=1))
    lines = [f"# Open WebUI {run['open_webui']} against chatengine {run['chatengine_commit']} ({run['when']})", ""]
    lines += [f"{run['chromium']}, headless; Open WebUI's settings as installed (single-user mode, offline)", ""]
    lines += [f"passed: {run['passed']}" + (f" ({run['error']})" if "error" in run else ""), ""]
    if "background_tasks_finished" in run:
        done = run["background_tasks_finished"]
        lines += [f"Open WebUI's background tasks (title, tags, follow-ups) done by the end: {done}", ""]
    lines += ["| request | status |", "|---|---|"]
    lines += [f"| {r['method']} {r['path']} | {r['status']} |" for r in run["requests"]]
    for name, text in (run.get("replies") or {}).items():
        lines += ["", f"**{name}**: {text[:300]}"]
    (out / f"compat_openwebui-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if run["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
