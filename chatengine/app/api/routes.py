"""OpenAI-compatible HTTP API (FastAPI) in front of AsyncLLM.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`, `POST /v1/completions`,
and `GET /health` (no auth). `server.py` mounts the Gradio UI on the app that `build_api` returns.

Choices (documented, deliberate):
- **Auth.** With a users dict, `Authorization: Bearer <api_key>` must match a user's `api_key`; that
  user's name goes to the engine as `user=` (the same identity, salt and cache isolation as in the
  UI). The request body's `user` field is accepted and ignored: it never chooses the cache namespace.
  Without users (local single-user mode) any key, or none, is accepted and `user=None`.
- **Model name.** Any `model` string is accepted (clients insist on sending one; this server serves
  exactly one model) and responses name the model actually served, `model_name`.
- **Strict where silence would lie.** Knobs we cannot honour (logprobs, tools, penalties != 0,
  logit_bias, JSON response_format, echo, suffix, best_of != n, several prompts in one completions
  request) are rejected with 400 and a message naming them; fields we do not know are ignored
  (like vLLM). vLLM extensions accepted: `top_k`, `ignore_eos`, `stop_token_ids`.
- **max_tokens.** `max_completion_tokens` wins over `max_tokens`. Without either, the completion
  may run to the end of the context (OpenAI's and vLLM's rule), capped by the engine's
  `max_tokens_limit`, the KV pool, and `default_max_tokens` when given.
- **cached_tokens** is always reported in `usage.prompt_tokens_details`. It only ever counts the
  caller's own cached blocks and the public persona prompts (the engine salts everything else by
  user), so it reveals nothing about other users.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad JSON / types /
ranges / roles / Unicode / prompt too long; 401 bad or missing key; 404 unknown route or model id;
413 body too large; 429 rate limit (with Retry-After); 503 engine stopped or request aborted by the
server; 500 only for a real engine failure (the forward pass raised). A streamed error after the
headers went out is sent as `data: {"error": ...}` followed by `data: [DONE]`.

A client that disconnects (streaming or not) has its engine request aborted at once, which frees
its KV blocks: a watcher task waits for the ASGI `http.disconnect` message and closes the engine's
generator.
"""
import asyncio
import json
import logging
import math
import time
import uuid
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatengine.app.auth import user_for_api_key
from chatengine.sampling_params import SamplingParams
from chatengine.engine.tokenizer import apply_chat_template, encode

log = logging.getLogger("chatengine.api")

ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class ClientDisconnected(Exception):
    pass


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# ---- request body -------------------------------------------------------------------------------
async def read_json_body(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        if declared > limit:
            raise APIError(413, f"the request body is {declared} bytes; this server accepts at most {limit}",
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes, the most this server accepts",
                           code="request_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise APIError(400, "the request body is empty: send a JSON object")

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(body, parse_constant=no_constants)
    except RecursionError:
        raise APIError(400, "invalid JSON: nested too deeply") from None
    except UnicodeDecodeError:
        raise APIError(400, "invalid JSON: the body is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:
        raise APIError(400, f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_json_type(data)}")
    _check_unicode(data, "")
    return data


def _check_unicode(value, path: str) -> None:
    """Reject lone surrogates anywhere (JSON can carry "\\ud800"; they cannot be encoded as UTF-8)."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                where = p or "the body"
                raise APIError(400, f"{where} is not valid Unicode: lone surrogate at position {e.start}",
                               param=p.split("[")[0].split(".")[0] or None) from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, f"{path} key" if not p else f"{p} key"))
                stack.append((item, f"{p}.{k}" if p else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in enumerate(v))


def _bad_type(name: str, want: str, value) -> APIError:
    return APIError(400, f"'{name}' must be {want}, got {_json_type(value)}", param=name)


def opt_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad_type(name, "a boolean", value)
    return value


def opt_number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_type(name, "a number", value)
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise APIError(400, f"'{name}' must be in {interval}, got {value}", param=name)
    return float(value)


def opt_int(body: dict, name: str, default, lo: int, hi: int):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(name, "an integer", value)
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {value}", param=name)
    return value


def reject_unsupported(body: dict, chat: bool) -> None:
    def unsupported(name, why="is not supported by this server"):
        raise APIError(400, f"'{name}' {why}", param=name)

    for name in ("presence_penalty", "frequency_penalty"):
        value = opt_number(body, name, 0.0, -2.0, 2.0)
        if value != 0:
            unsupported(name, "is not supported by this server; leave it out or send 0")
    if body.get("logit_bias") not in (None, {}):
        unsupported("logit_bias")
    if chat:
        if body.get("logprobs") not in (None, False):
            unsupported("logprobs")
        if body.get("top_logprobs") not in (None, 0):
            unsupported("top_logprobs")
        for name in ("tools", "functions"):
            if body.get(name) not in (None, []):
                unsupported(name, "(tool calling) is not supported by this server")
        if body.get("tool_choice") not in (None, "none", "auto"):
            unsupported("tool_choice", "(tool calling) is not supported by this server")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            unsupported("response_format", "is not supported by this server: only {\"type\": \"text\"}")
    else:
        if body.get("logprobs") not in (None, 0):
            unsupported("logprobs")
        if body.get("echo") not in (None, False):
            unsupported("echo")
        if body.get("suffix") not in (None, ""):
            unsupported("suffix")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad_type("user", "a string", user)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad_type("model", "a string", model)


def parse_stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage)."""
    stream = opt_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not isinstance(opts, dict):
        raise _bad_type("stream_options", "an object", opts)
    if not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include = opts.get("include_usage")
    continuous = opts.get("continuous_usage_stats")
    for name, value in (("include_usage", include), ("continuous_usage_stats", continuous)):
        if value is not None and not isinstance(value, bool):
            raise _bad_type(f"stream_options.{name}", "a boolean", value)
    return stream, bool(include), bool(continuous)


def parse_messages(value) -> list[dict]:
    if value is None:
        raise APIError(400, "'messages' is required: a non-empty array of {\"role\", \"content\"} objects",
                       param="messages")
    if not isinstance(value, list):
        raise _bad_type("messages", "an array of {\"role\", \"content\"} objects", value)
    if not value:
        raise APIError(400, "'messages' must not be empty", param="messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad_type(where, "an object with 'role' and 'content'", m)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLE_ALIASES:
            raise APIError(400, f"{where}.role must be one of system, developer, user, assistant; got "
                                f"{role!r}" if isinstance(role, str) else
                           f"{where}.role must be a string (system, developer, user or assistant)",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}]: only text parts {{\"type\": \"text\", \"text\": "
                                        f"\"...\"}} are supported", param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            raise APIError(400, f"{where}.content is missing or null (tool calls are not supported)",
                           param="messages")
        elif not isinstance(content, str):
            raise _bad_type(f"{where}.content", "a string or an array of text parts", content)
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    return messages


def parse_prompt(value):
    """A completions prompt: a string or a list of token ids (or a one-element list of either)."""
    if value is None:
        raise APIError(400, "'prompt' is required: a string or an array of token ids", param="prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise APIError(400, "'prompt' is empty", param="prompt")
        return value
    if isinstance(value, list):
        if not value:
            raise APIError(400, "'prompt' is empty", param="prompt")
        if all(isinstance(v, (str, list)) for v in value):
            raise APIError(400, f"'prompt' holds {len(value)} prompts; this server takes one prompt per "
                                "request (send several requests, or use 'n' for several samples)", param="prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in value):
            raise APIError(400, "'prompt' as an array must hold integer token ids only", param="prompt")
        return value
    raise _bad_type("prompt", "a string or an array of token ids", value)


def parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise _bad_type("stop", "a string or an array of strings", stop)
    for s in stop:
        if not isinstance(s, str):
            raise APIError(400, f"'stop' must be a string or an array of strings; it holds a {_json_type(s)}",
                           param="stop")
    if len(stop) > MAX_STOP or any(not s or len(s) > 256 for s in stop):
        raise APIError(400, f"'stop' must be at most {MAX_STOP} non-empty strings of at most 256 characters",
                       param="stop")
    return stop


# ---- rate limit ---------------------------------------------------------------------------------
class RateLimiter:
    """A token bucket per user: `per_minute` requests, refilled continuously; bursts up to `per_minute`."""

    def __init__(self, per_minute: int):
        if isinstance(per_minute, bool) or not isinstance(per_minute, int) or per_minute < 1:
            raise ValueError(f"rate_limit_per_minute must be a positive integer or None, got {per_minute!r}")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.buckets: dict[str | None, tuple[float, float]] = {}

    def check(self, key: str | None) -> float:
        """0.0 if allowed (a token is taken), else the seconds to wait."""
        now = time.monotonic()
        tokens, last = self.buckets.get(key, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self.buckets[key] = (tokens - 1.0, now)
            return 0.0
        self.buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate


# ---- the app ------------------------------------------------------------------------------------
def build_api(engine, users: dict | None, *, model_name: str, max_body_bytes: int = 1_000_000,
              rate_limit_per_minute: int | None = None, default_max_tokens: int | None = None) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible routes for `engine` (an AsyncLLM).

    users: the dict of `chatengine.app.auth.load_users`, or None for local single-user mode (any key).
    model_name: the id listed by /v1/models and named in every response.
    max_body_bytes: larger request bodies get 413.
    rate_limit_per_minute: completion requests per user per minute (token bucket), None = unlimited.
    default_max_tokens: cap on the completion length when the request names none (None: fill the context).
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError("model_name must be a non-empty string")
    if users is not None and not isinstance(users, dict):
        raise ValueError("users must be a dict (see chatengine.app.auth.load_users) or None")
    limiter = RateLimiter(rate_limit_per_minute) if rate_limit_per_minute is not None else None
    core = engine.engine
    created = int(time.time())
    app = FastAPI(title="chatengine OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.users, app.state.model_name = engine, users, model_name

    # ---- errors ---------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"unknown route {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        return JSONResponse(error_body(message, code="not_found" if e.status_code == 404 else None),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    # ---- helpers --------------------------------------------------------------------------------
    def authenticate(request: Request) -> str | None:
        if users is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <api_key>'",
                           code="invalid_api_key")
        try:   # headers arrive as latin-1; keys are stored as UTF-8 text
            token = token.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass
        user = user_for_api_key(users, token)
        if user is None:
            # with a rate limit, wrong keys also spend a per-address budget: no free key guessing
            host = request.client.host if request.client else "?"
            if limiter is not None and limiter.check(f"addr:{host}") > 0:
                raise APIError(429, "too many requests with a wrong API key; slow down", type="requests",
                               code="rate_limit_exceeded", headers={"Retry-After": "60"})
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return user

    def rate_limit(user: str | None) -> None:
        if limiter is None:
            return
        wait = limiter.check(user)
        if wait > 0:
            raise APIError(429, f"rate limit reached: at most {rate_limit_per_minute} requests per minute; "
                                f"retry in {math.ceil(wait)} s", type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(math.ceil(wait))})

    def engine_alive() -> bool:
        thread = getattr(engine, "_thread", None)
        return thread is None or thread.is_alive()

    def sampling_params(body: dict, prompt_len: int) -> SamplingParams:
        config = core.config
        limit = config.max_tokens_limit or core.max_model_len
        max_tokens = opt_int(body, "max_completion_tokens", None, 1, limit)
        if max_tokens is None:
            max_tokens = opt_int(body, "max_tokens", None, 1, limit)
        else:
            opt_int(body, "max_tokens", None, 1, limit)    # still type-checked
        if max_tokens is None:
            room = core.max_model_len - prompt_len
            pool_tokens = core.block_manager.num_blocks * core.config.block_size - prompt_len
            max_tokens = max(1, min(room, limit, pool_tokens, default_max_tokens or limit))
        n = opt_int(body, "n", 1, 1, config.max_n)
        best_of = opt_int(body, "best_of", None, 1, config.max_n)
        if best_of is not None and best_of != n:
            raise APIError(400, "'best_of' other than n is not supported by this server", param="best_of")
        top_k = opt_int(body, "top_k", 0, -1, 1 << 30)
        stop_token_ids = body.get("stop_token_ids")
        if stop_token_ids is not None and (not isinstance(stop_token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_token_ids)):
            raise _bad_type("stop_token_ids", "an array of non-negative integers", stop_token_ids)
        return SamplingParams(
            n=n,
            temperature=opt_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=max(top_k, 0),
            max_tokens=max_tokens,
            seed=opt_int(body, "seed", None, 0, 2**63 - 1),
            stop=parse_stop(body),
            stop_token_ids=stop_token_ids,
            ignore_eos=opt_bool(body, "ignore_eos"),
        )

    def prepare(kind: str, body: dict, user: str | None):
        """Tokenize and validate (in a worker thread: long prompts must not block other streams)."""
        tokenizer = core.tokenizer
        if kind == "chat":
            messages = parse_messages(body.get("messages"))
            try:
                ids = apply_chat_template(tokenizer, messages)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            except Exception as e:     # e.g. jinja2 TemplateError: "roles must alternate user/assistant"
                raise APIError(400, f"the model's chat template rejected these messages: {e}",
                               param="messages") from None
        else:
            prompt = parse_prompt(body.get("prompt"))
            try:
                ids = encode(tokenizer, prompt) if isinstance(prompt, str) else prompt
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
        params = sampling_params(body, len(ids))
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        try:     # the engine's own checks (context length, KV pool, vocabulary), without adding anything
            core.make_request(ids, params, request_id=request_id, user=user)
        except ValueError as e:
            message = str(e)
            param = ("max_tokens" if "max_tokens" in message else
                     "messages" if kind == "chat" and "prompt" in message else
                     "prompt" if "prompt" in message else None)
            code = "context_length_exceeded" if "context" in message else None
            raise APIError(400, message, param=param, code=code) from None
        return ids, params, request_id

    async def watch_disconnect(request: Request, request_id: str) -> None:
        """Wait for the client to go away, then abort its engine request at once (frees its blocks
        even while nobody is iterating the outputs, e.g. a stream blocked in a send)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                await engine.abort(request_id)
                return
            await asyncio.sleep(0.05)

    async def outputs(request: Request, ids, params, request_id, user):
        """Engine outputs until finished. A client disconnect or any early exit aborts the engine
        request (AsyncLLM frees its blocks)."""
        agen = engine.generate(ids, params, request_id=request_id, user=user)
        watcher = asyncio.ensure_future(watch_disconnect(request, request_id))
        pending = None
        finished = False
        try:
            while True:
                pending = asyncio.ensure_future(agen.__anext__())
                while True:
                    done, _ = await asyncio.wait({pending, watcher}, timeout=1.0,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if pending in done:
                        break
                    if watcher in done:
                        raise ClientDisconnected()
                    if not engine_alive():
                        raise APIError(503, "the engine has stopped", type="server_error")
                task, pending = pending, None
                try:
                    out = task.result()
                except StopAsyncIteration:
                    return
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            # synchronous first: under cancellation every await below may raise at once
            watcher.cancel()
            if pending is not None:
                pending.cancel()
            if not finished:
                await engine.abort(request_id)      # posts to the engine thread; does not suspend
            if pending is not None:
                try:
                    await pending
                except BaseException:
                    pass
            try:
                await agen.aclose()
            except BaseException:
                pass

    def usage(out) -> dict:
        completion = sum(len(c.token_ids) for c in out.outputs)
        prompt = len(out.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def failure(out) -> APIError | None:
        if out.error:
            log.error("engine failed request %s: %s", out.request_id, out.error)
            return APIError(500, "the engine failed while generating this completion", type="server_error")
        if any(c.finish_reason == "abort" for c in out.outputs):
            return APIError(503, "the request was aborted by the server (shutting down?)", type="server_error")
        return None

    async def handle(kind: str, request: Request):
        user = authenticate(request)
        rate_limit(user)
        body = await read_json_body(request, max_body_bytes)
        reject_unsupported(body, chat=kind == "chat")
        stream, include_usage, continuous = parse_stream(body)
        ids, params, request_id = await run_in_threadpool(prepare, kind, body, user)
        if not engine_alive():
            raise APIError(503, "the engine has stopped", type="server_error")
        if stream:
            gen = stream_events(kind, request, ids, params, request_id, user, include_usage, continuous)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = None
        try:
            async with aclosing(outputs(request, ids, params, request_id, user)) as outs:
                async for out in outs:
                    final = out
        except ClientDisconnected:
            return Response(status_code=499)
        except ValueError as e:        # refused by the engine when added
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None
        if final is None:
            raise APIError(503, "the engine returned no output", type="server_error")
        err = failure(final)
        if err is not None:
            raise err
        if kind == "chat":
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": None, "finish_reason": c.finish_reason} for c in final.outputs]
            obj = "chat.completion"
        else:
            choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                       for c in final.outputs]
            obj = "text_completion"
        return JSONResponse({"id": request_id, "object": obj, "created": int(time.time()), "model": model_name,
                             "choices": choices, "usage": usage(final), "system_fingerprint": None})

    async def stream_events(kind, request, ids, params, request_id, user, include_usage, continuous):
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created_at = int(time.time())

        def chunk(index, content, finish_reason, *, role=False, out=None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {"content": content} if content else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": content, "logprobs": None, "finish_reason": finish_reason}
            data = {"id": request_id, "object": obj, "created": created_at, "model": model_name, "choices": [choice]}
            if continuous and out is not None:
                data["usage"] = usage(out)
            return f"data: {_dumps(data)}\n\n"

        def error_event(e: APIError) -> str:
            return f"data: {_dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"

        n = params.n
        sent = [0] * n
        done = [False] * n
        last = None
        try:
            if chat:
                for i in range(n):
                    yield chunk(i, "", None, role=True)
            async with aclosing(outputs(request, ids, params, request_id, user)) as outs:
                async for out in outs:
                    last = out
                    err = failure(out)
                    for c in out.outputs:
                        i = c.index
                        if done[i]:
                            continue
                        text = c.text
                        delta = text[sent[i]:] if len(text) >= sent[i] else ""
                        sent[i] = max(sent[i], len(text))
                        if c.finish_reason in ("stop", "length"):
                            done[i] = True
                            yield chunk(i, delta, c.finish_reason, out=out)
                        elif delta and err is None:
                            yield chunk(i, delta, None, out=out)
                    if err is not None:
                        yield error_event(err)
                        yield "data: [DONE]\n\n"
                        return
            if include_usage and last is not None:
                data = {"id": request_id, "object": obj, "created": created_at, "model": model_name,
                        "choices": [], "usage": usage(last)}
                yield f"data: {_dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        except ClientDisconnected:
            return
        except APIError as e:
            yield error_event(e)
            yield "data: [DONE]\n\n"
        except (ValueError, RuntimeError) as e:
            yield error_event(APIError(400 if isinstance(e, ValueError) else 503, str(e),
                                       type="invalid_request_error" if isinstance(e, ValueError) else "server_error"))
            yield "data: [DONE]\n\n"

    # ---- routes ---------------------------------------------------------------------------------
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "chatengine",
                "max_model_len": core.max_model_len}

    @app.get("/health")
    async def health():
        if not engine_alive():
            return JSONResponse({"status": "error", "message": "the engine has stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(request: Request):
        authenticate(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        authenticate(request)
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("completion", request)

    known = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}

    # Last: unknown /v1 paths get OpenAI-style errors even when the UI is mounted at "/" (the mount
    # would otherwise answer them with its own 404 page).
    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
                   include_in_schema=False)
    async def unknown_v1(rest: str, request: Request):
        path = "/v1/" + rest
        if path.rstrip("/") in known:
            allowed = known[path.rstrip("/")]
            return JSONResponse(error_body(f"method {request.method} is not allowed on {path}; use {allowed}"),
                                status_code=405, headers={"Allow": allowed})
        raise APIError(404, f"unknown route {request.method} {path}", code="not_found")

    return app
