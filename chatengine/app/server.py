"""The chat server: one process serving the browser UI at / and the OpenAI-compatible API at /v1.

    python app.py [--host 127.0.0.1] [--port 7860] [--data-dir ./data] [--users users.json] ...

Without --users it is a single local user and no login (bind it to loopback only). With --users
a sign-in page guards the UI (sign-ins are kept in the database: they outlive a restart, see
sessions.py) and the API asks for the users' API keys.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
import sqlite3
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Self
from urllib.parse import urlsplit

from starlette.middleware.trustedhost import TrustedHostMiddleware

from chatengine.app import access_log, auth
from chatengine.app.datadir import check_data_dir, create_private_file, lock_data_dir, warn_if_shared
from chatengine.app.export import add_export_route
from chatengine.app.login_page import LoginPageMiddleware
from chatengine.app.login_routes import add_login_routes
from chatengine.app.login_throttle import LoginThrottle, LoginThrottleMiddleware
from chatengine.app.no_uploads import NoUploadsMiddleware
from chatengine.app.same_origin import SameOriginMiddleware, check_trusted_origins
from chatengine.app.session_guard import SessionOwnerMiddleware
from chatengine.app.sessions import COOKIE, LoginSessions, load_or_create_key

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no outbound calls from Gradio

log = logging.getLogger("chatengine.server")

API_RATE_LIMIT = 120  # API requests per user per minute when users sign in: a chat never needs more
# an API reply's cap when the client names none: a chat answer, not a run to the end of the context
DEFAULT_MAX_TOKENS = 2048
DB_FILE = "chat.db"
KV_DIR = "kv"
# command-line flags that are engine settings of the same name
ENGINE_FLAGS = (
    "device",
    "dtype",
    "kv_cache_gib",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "stream_interval",
    "max_model_len",
    "tensor_parallel_size",
    "data_parallel_size",
    "engine_process",
    "quantization",
    "deterministic",
)


def engine_kwargs(data_dir: str | os.PathLike | None, *, disk_kv: bool = True, **kwargs) -> dict:
    """AsyncLLM keyword arguments: `kwargs` without its None values (engine defaults), and the data
    directory's server secret and (with disk_kv) its disk tier of the KV cache."""
    out = {k: v for k, v in kwargs.items() if v is not None}
    if data_dir is not None:
        out["data_dir"] = os.fspath(data_dir)
        if disk_kv:
            out["kv_store_dir"] = os.fspath(Path(data_dir) / KV_DIR)
    return out


def create_app(
    *,
    data_dir: str | os.PathLike = "data",
    database_url: str | None = None,
    users_file: str | os.PathLike | None = None,
    engine=None,
    model: str | list[str | None] | None = None,
    engine_options: dict | None = None,
    kv_memory_split: str | None = None,
    title: str = "chatengine",
    max_n: int = 4,
    disk_kv: bool = True,
    api_rate_limit: int | None = API_RATE_LIMIT,
    cors_origins: list[str] | None = None,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    secure_cookies: bool = False,
    trusted_origins: list[str] | None = None,
    allowed_hosts: list[str] | None = None,
):
    """Build the ASGI app (FastAPI with the API routes and the Gradio UI mounted at "/").

    ``engine``: an AsyncLLM to use, or several (ServedModels or a list; tests share them; they stay up
    at close_app); otherwise one engine per ``model`` (a name or a list of them: several models, the
    first the default) is built from ``engine_options``, the memory split by ``kv_memory_split``
    ("0.6,0.4"; see memory_split.py). ``api_rate_limit``: API requests per user per minute
    with ``users_file`` (None or 0: unlimited). ``users_file``: see ``auth.load_users``; None = a single
    local user without login. ``cors_origins``: origins whose pages may call the API (None: no CORS).
    ``default_max_tokens``: an API reply's cap when the request names no max_tokens (None or 0: the
    context's room, or the model's own max_new_tokens). ``secure_cookies``: the sign-in cookie is
    Secure even on requests that look like plain http (TLS ends at a proxy in front). A POST outside
    the API must come from a page of the host it was sent to, or of one of ``trusted_origins`` (the
    public origins of a proxy that rewrites Host): see same_origin.py.
    ``database_url``: a PostgreSQL database (postgresql://...) for the users and conversations, which
    several servers may share; None: the SQLite file in ``data_dir``.
    ``app.state.chat`` holds the engines (``models``; ``engine``: the default's), the store, the
    accounts (users.py) and the personas (persona_catalog.py).
    """
    import gradio as gr

    from chatengine.app.api.cors import check_origins
    from chatengine.app.api.routes import build_api
    from chatengine.app.memory_split import parse_split
    from chatengine.app.model_chats import ModelChats
    from chatengine.app.models import ServedModels
    from chatengine.app.persona_catalog import PersonaCatalog
    from chatengine.app.ui.handlers import LOCAL_USER
    from chatengine.app.ui.layout import CSS, build_ui, page_js, theme
    from chatengine.app.users import AdminSet, UserDirectory
    from chatengine.personas import load_personas

    # checks that can fail run before the model loads: a bad directory or database costs one line at once
    if users_file is not None:
        warn_if_shared(users_file)
    users = auth.load_users(users_file) if users_file is not None else None
    if cors_origins:
        check_origins(cors_origins)
    trusted = check_trusted_origins(trusted_origins or ())
    if default_max_tokens is not None and (isinstance(default_max_tokens, bool) or default_max_tokens < 0):
        raise ValueError(f"--default-max-tokens must be 0 (no cap) or a positive number, got {default_max_tokens}")
    names = model if isinstance(model, list) else [model]
    fractions = parse_split(kv_memory_split, len(names))  # before the models load
    data = check_data_dir(data_dir)  # private: conversations are there in plain text
    lock = lock_data_dir(data)  # one server per data dir, and none while users are deleted offline
    try:
        store = _open_store(database_url or data / DB_FILE)
    except BaseException:
        lock.close()
        raise
    accounts = UserDirectory(store)
    if users is not None:  # the file is an import: the database holds the accounts from now on
        try:
            accounts.import_users(users)
        except BaseException:
            store.close()
            lock.close()
            raise
    own_engine = engine is None
    try:
        models = (
            _load_models(names, fractions, data, disk_kv, engine_options) if own_engine else ServedModels.of(engine)
        )
    except BaseException:
        store.close()
        lock.close()
        raise
    engine = models.default
    # prompts/ seed the personas; public ones are registered with every model's engine
    catalog = PersonaCatalog(store, [e for _, e in models.items()], load_personas())
    service = ModelChats.build(models, store, catalog=catalog)
    limit = api_rate_limit if users is not None and api_rate_limit else None
    app = build_api(
        models,
        accounts if users is not None else None,
        model_name=models.default_id,
        rate_limit_per_minute=limit,
        cors_origins=cors_origins,
        default_max_tokens=default_max_tokens or None,
    )
    demo = build_ui(
        service,
        auth_enabled=users is not None,
        title=title,
        max_n=max_n,
        admins=AdminSet(accounts),
        default_max_tokens=default_max_tokens or None,
        accounts=accounts,
        catalog=catalog,
    )
    user_of = auth_dependency = None  # who a request's cookies sign in; None throughout without --users
    if users is not None:
        # a disabled user's cookies sign in no one, and disabling ends their sign-ins for good
        sessions = LoginSessions(store, load_or_create_key(data), is_active=accounts.is_active)
        accounts.on_disable.append(sessions.revoke_user)
        auth_dependency = add_login_routes(app, sessions, _login_check(accounts), secure=secure_cookies)
        user_of = lambda cookies: sessions.user_of(cookies.get(COOKIE))  # noqa: E731
    add_export_route(app, store, auth_dependency or (lambda request: LOCAL_USER))
    app = gr.mount_gradio_app(
        app,
        demo,
        path="/",
        auth_dependency=auth_dependency,
        auth_message="Sign in to chatengine" if users is not None else None,
        theme=theme(),
        css=CSS,
        js=page_js(),
        ssr_mode=False,
        footer_links=["settings"],
        show_error=True,
    )
    app.add_middleware(NoUploadsMiddleware)  # no feature takes files
    if user_of is not None:  # password guessing: 429 with Retry-After past a few failures
        app.add_middleware(LoginThrottleMiddleware, throttle=LoginThrottle())
        # a UI event carries one message (of the model that reads most): JSON escapes take <= 6 bytes a character
        chars = max(e.max_prompt_chars for _, e in models.items())
        app.add_middleware(
            SessionOwnerMiddleware,
            user_of=user_of,
            max_body_bytes=6 * chars + (256 << 10),
            too_large=f"This message is too long: this model reads at most about {chars:,} characters.",
        )
        app.add_middleware(LoginPageMiddleware, user_of=user_of, title=title, message="Sign in to chatengine")
    # outermost: another site's POST is refused before it is throttled, read or checked
    app.add_middleware(SameOriginMiddleware, trusted_origins=trusted)
    if allowed_hosts:  # before everything: a page on a name rebound to this address gets a 400
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    access_log.install()
    app.state.chat = SimpleNamespace(
        engine=engine, models=models, store=store, own_engine=own_engine, lock=lock, accounts=accounts, catalog=catalog
    )
    return app


def _load_models(names: list, fractions: list[float], data: Path, disk_kv: bool, engine_options: dict | None):
    """ServedModels of one engine per model name, each with its share of the memory; the engines
    already started stop again if a later one fails (its error names the model)."""
    from chatengine import AsyncLLM, DataParallelLLM
    from chatengine.app.memory_split import split_options
    from chatengine.app.models import ServedModels

    engines: list = []
    try:
        for name, options in zip(names, split_options(engine_options or {}, fractions)):
            kwargs = engine_kwargs(data, disk_kv=disk_kv, **options)
            replicas, own_process = kwargs.pop("data_parallel_size", 1), kwargs.pop("engine_process", False)
            engine = (
                DataParallelLLM(name, data_parallel_size=replicas, **kwargs)
                if replicas > 1 or own_process
                else AsyncLLM(name, **kwargs)
            )
            engines.append(engine)
        return ServedModels.of(engines)
    except BaseException:
        for e in engines:
            e.shutdown()
        raise


def _open_store(path: Path | str):
    """The chat store: the SQLite file ``path`` (private), or a PostgreSQL database (``path`` a URL)."""
    from chatengine.app.store import ChatStore, StoreDamaged, StoreWriteError, open_store

    if isinstance(path, str):
        store = open_store(path)  # a ValueError that names the database without its password
        try:
            interrupted = store.recover_interrupted()
        except StoreWriteError as e:
            store.close()
            raise ValueError(f"cannot write to the chat database ({e})") from None
        return _log_interrupted(store, interrupted)
    try:
        create_private_file(path)
        store = ChatStore(path)
        interrupted = store.recover_interrupted()
    except (sqlite3.DatabaseError, StoreDamaged) as e:
        raise ValueError(
            f"the chat database {path} is damaged ({e}): restore it from a backup, or move it aside "
            "to start with an empty history"
        ) from None
    except (OSError, StoreWriteError) as e:
        raise ValueError(f"cannot open the chat database {path} ({e}): check the disk and the data directory") from None
    return _log_interrupted(store, interrupted)


def _log_interrupted(store, interrupted: int):
    if interrupted:
        log.info("marked %d replies interrupted by the last shutdown", interrupted)
    return store


def _login_check(accounts):
    # a hashed password costs ~0.3 s of PBKDF2: off the event loop that streams replies, one at a
    # time, on a thread of low CPU priority, so guesses take little from the engine on a busy CPU
    # (nice 10 weighs a tenth of the engine's threads: a sign-in on a saturated core takes ~3 s;
    # nice 19 would make it ~20 s)
    hashing = ThreadPoolExecutor(1, thread_name_prefix="sign-in", initializer=_low_cpu_priority)

    async def check_login(username: str, password: str) -> bool:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(hashing, accounts.verify_password, username, password)

    return check_login


SIGN_IN_NICE = 10


def _low_cpu_priority() -> None:
    """SIGN_IN_NICE for the calling thread alone (Linux gives each thread its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SIGN_IN_NICE)
    except (OSError, AttributeError):  # another OS: the thread keeps the process's priority
        pass


def close_app(app) -> None:
    """Shut the engine down (flushing its KV store) unless it was given to create_app; close the database."""
    chat = app.state.chat
    if chat.own_engine:
        chat.models.shutdown()
    chat.store.close()
    chat.lock.close()


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (an ephemeral port) in a daemon thread of this process: for
    tests and benchmarks that drive a real server and look at its engine and store meanwhile."""

    def __init__(self, app, *, startup_timeout: float = 60.0):
        import uvicorn

        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _HelpFormatter(argparse.HelpFormatter):
    """Shows "(default: X)" only where there is a default worth naming."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="chatengine: a multi-user chat app (browser UI at /, OpenAI-compatible API at /v1) "
        "on its own paged-KV LLM engine.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; use 0.0.0.0 to accept other machines (only with --users)",
    )
    p.add_argument("--port", type=int, default=7860, help="TCP port")
    p.add_argument(
        "--data-dir",
        default="./data",
        help=f"where the server keeps its state: the SQLite database ({DB_FILE}), the disk tier "
        f"of the KV cache ({KV_DIR}/) and the server secret that salts per-user cache keys",
    )
    p.add_argument(
        "--database-url",
        metavar="URL",
        default=None,
        help="keep users and conversations in this PostgreSQL database instead of the SQLite file in --data-dir "
        "(several servers may share it): postgresql://USER@HOST:PORT/DATABASE, the password in PGPASSWORD or "
        "~/.pgpass (a password in the URL works too, but ps shows command lines). Needs the postgres extra: "
        "pip install 'chatengine[postgres]'",
    )
    p.add_argument(
        "--users",
        metavar="FILE",
        default=None,
        help='JSON file of users: {"alice": {"password": "...", "api_key": "...", "admin": true}}; passwords '
        "may be hashed (python -m chatengine.app.auth hash); admins see the Engine tab. Without it: one "
        "local user, no login",
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="a .gguf file, a Hugging Face model directory or repo id (org/name: the local HF cache, else "
        "downloaded); default: the embedded SmolLM2-135M-Instruct ('default' names it). Repeat it to serve "
        "several models at once, each with its own engine and KV cache: the first is the default, the API's "
        "'model' field and the UI's model picker choose one (by the id /v1/models lists: the name as given here)",
    )
    p.add_argument(
        "--kv-memory-split",
        metavar="F1,F2,...",
        default=None,
        help="with several --model: each model's share of the memory flags below, in --model order, adding up to 1 "
        "(e.g. 0.6,0.4): on CPU of --kv-cache-gib and of the host and disk tiers; on CUDA of "
        "--gpu-memory-utilization (weights, activations and KV pages of each). Default: equal shares",
    )
    p.add_argument("--device", default=None, help='"cuda" or "cpu"; default: cuda when available')
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16; default: bf16 on CUDA, fp32 on CPU")
    p.add_argument(
        "--quantization",
        choices=["none", "fp8", "q8_0", "q4_0", "q4_1", "gguf"],
        default="gguf",
        help="fp8: e4m3 weights with per-channel scales for the linear layers (GPUs of compute capability "
        "8.9+: half the weight memory and bytes per decode step); q8_0/q4_0/q4_1: GGML blocks on the CPU; "
        "gguf (default): a GGUF file's own block format on the CPU (the embedded model: q4_1), full "
        "precision on a GPU and for other weights; none: full precision everywhere",
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=None, help="CPU: size of the KV page pool in GiB (engine default 1.0)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: share of GPU memory the engine may use (engine default 0.85)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="most sequences in one engine step (engine default 256)"
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="a streamed reply's chunk every N engine steps, its first token at once (default: 1 in one "
        "engine; replicas (--data-parallel-size, --engine-process) 1 up to 128 running streams, then up to 4 "
        "as more run): fewer, longer chunks cost the API process less per token",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step: prefill chunks plus decodes (engine default 2048)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length in tokens; default: the model's, capped at 8192"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="GPUs to split the model over, one process each (engine default 1); the disk tier of the KV "
        "cache is not supported above 1: use it with --no-disk-kv",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=None,
        help="engine replicas, each in its own process on its own GPUs (tensor-parallel-size of them), behind "
        "this one server: a conversation goes to the replica that holds its pages, a new one to the least loaded "
        "(default 1: one engine in this process)",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        default=None,
        help="run the engine in a process of its own even with one replica: HTTP, SSE and tokenizing then never "
        "wait for the engine's Python work (always so with --data-parallel-size above 1)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="batch- and cache-invariant inference: the same prompt and seed give the same tokens and logprobs "
        "whatever shares the batch and whether its prefix came from the cache, host memory or disk (slower)",
    )
    p.add_argument(
        "--no-disk-kv", action="store_true", help="keep the KV cache in memory only (no disk tier under --data-dir)"
    )
    p.add_argument(
        "--api-rate-limit",
        type=int,
        default=API_RATE_LIMIT,
        help="API requests per user per minute with --users (429 past it); 0: unlimited",
    )
    p.add_argument(
        "--cors-origins",
        nargs="+",
        metavar="ORIGIN",
        default=None,
        help="let pages of these origins call the API from a browser (e.g. https://chat.example.org "
        "http://localhost:3000; '*' for any); only /v1 and /health, never with cookies. Default: off",
    )
    p.add_argument(
        "--secure-cookies",
        action="store_true",
        help="mark the sign-in cookie Secure (sent over https only) whatever the scheme the server sees: "
        "for TLS ending at a reverse proxy in front of it. Without it the cookie is Secure only on "
        "requests that arrive as https (or that a trusted proxy forwards as https, --forwarded-allow-ips)",
    )
    p.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        default=None,
        help="comma-separated addresses of reverse proxies whose X-Forwarded-For/-Proto headers are "
        "believed (client address, https); '*' trusts any. Default: uvicorn's (127.0.0.1, or the "
        "FORWARDED_ALLOW_IPS environment variable)",
    )
    p.add_argument(
        "--trusted-origins",
        nargs="+",
        metavar="ORIGIN",
        default=None,
        help="origins of this server's own pages besides the host a request names (e.g. "
        "https://chat.example.org behind a proxy that rewrites the Host header): sign-in, logout and "
        "UI events from pages elsewhere are refused (403). Default: none",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="an API reply's length cap when the client sends no max_tokens (Open WebUI sends none), and the "
        "UI's Max tokens to start with, within the model's context; 0: up to the context. Sampling settings "
        "a client leaves out come from the model's generation_config.json",
    )
    p.add_argument(
        "--max-alternatives", type=int, default=4, help="largest n (parallel alternatives per turn) offered in the UI"
    )
    p.add_argument("--title", default="chatengine", help="name shown in the browser tab and sidebar")
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    return p


def uvicorn_proxy_options(forwarded_allow_ips: str | None) -> dict:
    """uvicorn.run's proxy settings: its own defaults unless --forwarded-allow-ips names the proxies."""
    if forwarded_allow_ips is None:
        return {}
    return {"proxy_headers": True, "forwarded_allow_ips": forwarded_allow_ips}


EMBEDDED = "default"  # --model default: the embedded model, to serve it beside others


def model_names(flags: list[str] | None) -> str | list[str | None] | None:
    """create_app's ``model`` from the --model flags: None (the embedded default), one name, or a
    list of several; "default" names the embedded model unless a file or directory has that name."""
    if not flags:
        return None
    names: list[str | None] = [None if f == EMBEDDED and not Path(f).exists() else f for f in flags]
    return names if len(names) > 1 else names[0]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback_hosts(bind: str, trusted_origins: list[str] | None) -> list[str] | None:
    """The Host names a server bound to loopback answers (None: any, it is bound elsewhere). A page
    of another site whose name the attacker rebinds to 127.0.0.1 (DNS rebinding) sends its own name
    as Host and Origin, and passes the same-origin check: the Host check refuses it."""
    if bind not in LOOPBACK:
        return None
    names = ["localhost", "127.0.0.1", "[::1]", "::1"]
    return names + [urlsplit(o).hostname or "" for o in trusted_origins or ()]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.users is None and args.host not in LOOPBACK:
        log.warning("listening on %s without --users: anyone who can reach it is the local user", args.host)
    import uvicorn

    engine_options = {name: getattr(args, name) for name in ENGINE_FLAGS}
    trusted_origins = [o for arg in args.trusted_origins or () for o in arg.split(",") if o] or None
    try:
        app = create_app(
            data_dir=args.data_dir,
            database_url=args.database_url,
            users_file=args.users,
            model=model_names(args.model),
            kv_memory_split=args.kv_memory_split,
            title=args.title,
            max_n=args.max_alternatives,
            disk_kv=not args.no_disk_kv,
            api_rate_limit=args.api_rate_limit,
            cors_origins=[o for arg in args.cors_origins or () for o in arg.split(",") if o] or None,
            default_max_tokens=args.default_max_tokens,
            engine_options=engine_options,
            secure_cookies=args.secure_cookies,
            trusted_origins=trusted_origins,
            allowed_hosts=loopback_hosts(args.host, trusted_origins),
        )
    except ValueError as e:  # a bad flag value, users file or model path
        sys.exit(f"error: {e}")
    # the process lives as long as what start-up built (models, libraries): out of the cyclic
    # collector's sight, a full collection while serving walks only what serving makes
    gc.collect()
    gc.freeze()
    print(f"chatengine: open http://{args.host}:{args.port}/  (API at /v1)", flush=True)
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            **uvicorn_proxy_options(args.forwarded_allow_ips),
        )
    finally:
        close_app(app)


if __name__ == "__main__":
    main()
