"""The `chatengine` command: `serve` (the web UI and the OpenAI-compatible API), `chat` (a terminal
chat on the engine, streaming) and `bench` (the scripts in benchmarks/)."""

import argparse
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmarks"
MAIN_BLOCK = re.compile(r"^if __name__ == .__main__.:", re.M)
DEFAULT_BENCH = "cpu_throughput"

DESCRIPTION = """\
chatengine: a multi-user chat app on its own paged-KV LLM engine.

commands:
  serve        run the web UI and the OpenAI-compatible HTTP API (/v1) in one process;
               `chatengine serve --help` lists its flags (the same as `python app.py`)
  chat         chat with the model in this terminal (streaming, multi-turn; /reset, /quit)
  delete-user  delete a user's conversations and cached KV pages from a data dir (server stopped)
  bench        run a benchmark script from benchmarks/ (`chatengine bench --list`)
"""

CHAT_HELP = """\
In the chat: type a message and press Enter. Commands: /reset clears the conversation (keeps the
system prompt), /quit (or /exit, or end of input) leaves, /help shows this. Ctrl-C while the model
is answering stops that answer."""

BENCH_HELP = """\
usage: chatengine bench [SCRIPT] [ARGS...]
       chatengine bench --list

Runs benchmarks/SCRIPT.py (default: {default}) with ARGS passed through unchanged, so
`chatengine bench {default} --help` shows that script's own flags. Flags given without a
script name go to the default script.

  SCRIPT      a script in benchmarks/ (with or without .py)
  --list      list the available scripts
  -h, --help  show this help
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatengine", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,chat,delete-user,bench}")
    sub.add_parser(
        "serve", help="run the web UI and the OpenAI-compatible API (see `chatengine serve --help`)", add_help=False
    )
    chat = sub.add_parser(
        "chat",
        help="chat with the model in the terminal",
        description="A terminal chat on the engine: streams the answer token by token and "
        "keeps the conversation until /reset.",
        epilog=CHAT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="weights to load: a .gguf file, a Hugging Face model directory, or "
        "'dummy:<shape>' (default: the embedded SmolLM2-135M-Instruct)",
    )
    chat.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="torch device, e.g. 'cpu' or 'cuda' (default: cuda when available, else cpu)",
    )
    chat.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature; 0 is greedy (always the most likely token). Default 0.7",
    )
    chat.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: sample from the smallest set of tokens whose probability "
        "adds up to this, in (0, 1]. Default 1.0 (off)",
    )
    chat.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="the longest answer in tokens; longer answers are cut off. Default 512",
    )
    chat.add_argument(
        "--seed", type=int, default=None, help="seed for sampling, to make answers reproducible (default: random)"
    )
    who = chat.add_mutually_exclusive_group()
    who.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system prompt that sets the assistant's behaviour for the whole chat",
    )
    who.add_argument(
        "--persona",
        default=None,
        metavar="NAME",
        help="use the system prompt of a persona from prompts/ (see --list-personas)",
    )
    chat.add_argument("--list-personas", action="store_true", help="list the personas and exit")
    chat.add_argument(
        "--kv-cache-gib", type=float, default=0.5, help="memory for the KV cache on CPU, in GiB (default 0.5)"
    )
    delete = sub.add_parser(
        "delete-user",
        help="delete a user's conversations and cached KV pages (with the server stopped)",
        description="Delete everything a user left in a data directory: their conversations and "
        "messages in the database and their private KV pages in the disk cache (of every model). "
        "The server must be stopped (it holds the user's pages in memory); remove the user from the "
        "--users file too, or they can sign in again with an empty history.",
    )
    delete.add_argument("user", help="the user name, as in the --users file ('local' without --users)")
    delete.add_argument("--data-dir", default="./data", help="the server's --data-dir (default ./data)")
    delete.add_argument(
        "--database-url",
        default=None,
        metavar="URL",
        help="the server's --database-url (PostgreSQL), where its conversations are; the --data-dir's KV pages "
        "are deleted too where that directory is on this machine (run it on every server's machine)",
    )
    sub.add_parser("bench", help="run a benchmark from benchmarks/ (see `chatengine bench --help`)", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return serve(argv[1:])
    if argv and argv[0] == "bench":
        return bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "chat":
        return chat(args)
    if args.command == "delete-user":
        return delete_user(args.user, args.data_dir, args.database_url)
    parser.print_help()
    return 2


# ---- serve --------------------------------------------------------------------------------------
def serve(argv: list[str]) -> int:
    from chatengine.app import server

    server.main(argv)
    return 0


# ---- delete-user --------------------------------------------------------------------------------
def delete_user(user: str, data_dir: str, database_url: str | None = None) -> int:
    """With ``database_url`` (PostgreSQL) the data dir is optional: its KV pages go where it exists."""
    from chatengine import LLMEngine
    from chatengine.app.datadir import DataDirError, lock_data_dir
    from chatengine.app.server import DB_FILE, KV_DIR
    from chatengine.app.store import open_store

    root = Path(data_dir)
    if database_url is None and not (root / DB_FILE).is_file():
        print(f"chatengine delete-user: no chat database in {root} (is --data-dir right?)", file=sys.stderr)
        return 2
    try:
        lock = lock_data_dir(root) if root.is_dir() else None
    except DataDirError as e:
        print(f"chatengine delete-user: {e}", file=sys.stderr)
        return 1
    try:
        try:
            store = open_store(database_url or root / DB_FILE)
        except ValueError as e:  # a PostgreSQL URL that does not connect (named without its password)
            print(f"chatengine delete-user: {e}", file=sys.stderr)
            return 2
        try:
            conversations = len(store.list_conversations(user))
            store.delete_user(user)
        finally:
            store.close()
        pages = LLMEngine.forget_user_on_disk(str(root / KV_DIR), str(root), user) if (root / KV_DIR).is_dir() else 0
    finally:
        if lock is not None:
            lock.close()
    print(f"deleted user {user!r}: {conversations} conversations, {pages} cached KV pages")
    return 0


# ---- bench --------------------------------------------------------------------------------------
def bench_scripts() -> dict[str, Path]:
    """The runnable scripts of benchmarks/: those with a main block (common.py and other helpers
    that the scripts import have none)."""
    if not BENCH_DIR.is_dir():
        return {}
    return {
        p.stem: p
        for p in sorted(BENCH_DIR.glob("*.py"))
        if not p.name.startswith("_") and MAIN_BLOCK.search(p.read_text(encoding="utf-8", errors="replace"))
    }


def bench(argv: list[str]) -> int:
    scripts = bench_scripts()
    if argv and argv[0] in ("-h", "--help"):
        print(BENCH_HELP.format(default=DEFAULT_BENCH))
        print("scripts:", ", ".join(scripts) or "(none yet)")
        return 0
    if argv and argv[0] == "--list":
        for name in scripts:
            print(name)
        return 0
    name, rest = DEFAULT_BENCH, argv
    if argv and not argv[0].startswith("-"):
        name, rest = argv[0].removesuffix(".py"), argv[1:]
    script = scripts.get(name)
    if script is None:
        where = f"in {BENCH_DIR}" if BENCH_DIR.is_dir() else f"({BENCH_DIR} does not exist)"
        print(
            f"chatengine bench: no benchmark {name!r} {where}; available: {', '.join(scripts) or 'none'}",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    try:
        return subprocess.call([sys.executable, str(script), *rest], env=env, cwd=str(REPO_ROOT))
    except KeyboardInterrupt:
        return 130


# ---- chat ---------------------------------------------------------------------------------------
def chat(args) -> int:
    from chatengine.personas import load_personas

    if args.list_personas or args.persona:
        try:
            personas = load_personas()
        except ValueError as e:
            print(f"chatengine chat: {e}", file=sys.stderr)
            return 2
        if args.list_personas:
            for p in personas.values():
                print(f"{p.name:18} {p.title}: {p.description}")
            return 0
        if args.persona not in personas:
            print(
                f"chatengine chat: no persona {args.persona!r}; choose one of: {', '.join(personas) or 'none'}",
                file=sys.stderr,
            )
            return 2
        system = personas[args.persona].system_prompt
    else:
        system = args.system

    from chatengine import AsyncLLM, SamplingParams

    print("loading the model...", file=sys.stderr, flush=True)
    try:
        engine = AsyncLLM(args.model, device=args.device, kv_cache_gib=args.kv_cache_gib)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
        )
        params.validate(engine.max_n, engine.max_tokens_limit)
    except (ValueError, OSError) as e:
        print(f"chatengine chat: {e}", file=sys.stderr)
        return 2
    try:
        if engine.get_tokenizer() is None:
            print(
                "chatengine chat: this model has no tokenizer (dummy weights); chat needs real weights", file=sys.stderr
            )
            return 2
        print(f"{engine.model_id} on {engine.stats()['device']}. {CHAT_HELP}", file=sys.stderr, flush=True)
        _converse(engine, system, params)
    finally:
        engine.shutdown()
    return 0


def _converse(engine, system: str | None, params) -> None:
    """The read-answer loop until /quit or end of input."""
    interactive = sys.stdin.isatty()
    base = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print(file=sys.stderr)
            return
        text = _command(line.strip(), history)
        if text is None:
            continue
        if text is _QUIT:
            return
        history.append({"role": "user", "content": text})
        try:
            ids = _fit(engine, base, history, params.max_tokens)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            history.pop()
            continue
        reply = _stream_answer(engine, ids, params, interactive)
        if reply is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": reply})


_QUIT = object()


def _command(text: str, history: list[dict]):
    """A line typed at the prompt: the message to send, None (nothing to send) or _QUIT."""
    if not text:
        return None
    if not text.startswith("/"):
        return text
    command = text.split()[0].lower()
    if command in ("/quit", "/exit"):
        return _QUIT
    if command == "/reset":
        history.clear()
        print("(conversation cleared)", file=sys.stderr, flush=True)
    elif command == "/help":
        print(CHAT_HELP, file=sys.stderr, flush=True)
    elif text.startswith("//"):
        return text[1:]
    else:
        print(
            f"unknown command {command}; try /help (start with // to send a message beginning with /)",
            file=sys.stderr,
            flush=True,
        )
    return None


def _fit(engine, base, history, max_tokens) -> list[int]:
    """Token ids of the conversation; drops the oldest turns while it does not fit the context."""
    while True:
        ids = engine.apply_chat_template(base + history)
        room = engine.max_model_len - len(ids)
        if room >= min(max_tokens, 64) or len(history) <= 1:
            if room < 1:
                raise ValueError(
                    f"this message is too long for the context ({len(ids)} tokens of "
                    f"{engine.max_model_len}); shorten it"
                )
            return ids
        del history[:2]  # the oldest user turn and its answer
        print("(the conversation is longer than the context: dropped the oldest turn)", file=sys.stderr)


def _stream_answer(engine, ids, params, interactive) -> str | None:
    """Print the reply as it streams; Ctrl-C stops it (what was written is kept). None: refused."""
    out = sys.stdout
    state: dict = {"text": "", "sent": 0}

    async def stream() -> None:
        async for o in engine.generate(ids, params):
            state["text"] = o.outputs[0].text
            out.write(state["text"][state["sent"] :])
            out.flush()
            state["sent"] = len(state["text"])
            if o.finished and o.error:
                print(f"\nerror: the engine failed: {o.error}", file=sys.stderr)

    try:
        engine.check_request(ids, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return None
    if interactive:
        out.write("assistant> ")
    try:
        asyncio.run(stream())  # closing the stream on Ctrl-C aborts the request in the engine
    except KeyboardInterrupt:
        out.write(" [stopped]")
    out.write("\n")
    out.flush()
    return state["text"]


if __name__ == "__main__":
    sys.exit(main())
