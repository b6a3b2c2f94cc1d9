"""The OpenAI wire protocol, request side: reading and validating a body into a request model.

Validation is by hand, field by field, so that every message names the field and says what was wrong
in words a client's author can act on (pydantic's own messages and status would differ from the ones
this API promises). What passes lands in the pydantic models below, which are the typed request the
routes work with. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

import json
import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from chatengine import SamplingParams

Kind = Literal["chat", "completion"]  # the two routes: /v1/chat/completions, /v1/completions
Role = Literal["system", "user", "assistant"]
ROLE_ALIASES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 16
MAX_STOP_CHARS = 256


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- the request models -------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)


class ChatMessage(_Model):
    role: Role  # "developer" arrives as "system"
    content: str  # text parts arrive joined by newlines


class StreamOptions(_Model):
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage in every chunk


class Sampling(_Model):
    """The sampling fields of a request; max_tokens None: as long as the context and limits allow."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Model):
    """One request of either route: `messages` for chat, `prompt` (text or token ids) for completions."""

    kind: Kind
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    stream: StreamOptions = StreamOptions()
    sampling: Sampling = Sampling()


@dataclass(frozen=True)
class Limits:
    """What the engine allows, read once from it; default_max_tokens is the server's own cap."""

    max_n: int
    max_tokens: int
    max_model_len: int
    kv_capacity_tokens: int
    default_max_tokens: int | None = None
    max_prompt_chars: int | None = None  # longer prompt text is refused before tokenizing

    @classmethod
    def of(cls, engine, default_max_tokens: int | None = None) -> "Limits":
        return cls(
            engine.max_n,
            engine.max_tokens_limit,
            engine.max_model_len,
            engine.kv_capacity_tokens,
            default_max_tokens,
            engine.max_prompt_chars,
        )


def parse_request(kind: Kind, body: dict, limits: Limits) -> CompletionRequest:
    """The request model of a JSON body, or the APIError (400) of its first bad field."""
    chat = kind == "chat"
    reject_unsupported(body, chat=chat)
    stream = parse_stream(body)
    if chat:
        messages, prompt = parse_messages(body.get("messages")), None
    else:
        messages, prompt = None, parse_prompt(body.get("prompt"))
    check_text_length(messages, prompt, limits)
    return CompletionRequest(
        kind=kind, messages=messages, prompt=prompt, stream=stream, sampling=parse_sampling(body, limits)
    )


def check_text_length(messages: list[ChatMessage] | None, prompt, limits: Limits) -> None:
    """Refuse text that cannot fit the context before the tokenizer spends time on it."""
    if limits.max_prompt_chars is None:
        return
    chars = sum(len(m.content) for m in messages) if messages is not None else len(prompt or "")
    if isinstance(prompt, list):
        chars = 0  # token ids: their count is checked against the context as it is
    if chars > limits.max_prompt_chars:
        raise APIError(
            400,
            f"the {'messages' if messages is not None else 'prompt'} hold {chars} characters; this model reads at most "
            f"{limits.max_model_len} tokens (about {limits.max_prompt_chars} characters): shorten the input",
            param="messages" if messages is not None else "prompt",
            code="context_length_exceeded",
        )


def sampling_params(sampling: Sampling, prompt_len: int, limits: Limits) -> SamplingParams:
    """The engine's SamplingParams; without max_tokens the completion may fill the context, capped by
    the engine's max_tokens limit, the KV pool and the server's default_max_tokens."""
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        room = limits.max_model_len - prompt_len
        pool = limits.kv_capacity_tokens - prompt_len
        max_tokens = max(1, min(room, limits.max_tokens, pool, limits.default_max_tokens or limits.max_tokens))
    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),
        max_tokens=max_tokens,
        seed=sampling.seed,
        stop=list(sampling.stop),
        stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos,
    )


# ---- the body -----------------------------------------------------------------------------------
async def read_json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 over `limit` bytes, 400 for anything but a JSON object of valid
    Unicode (NaN and Infinity are not JSON)."""
    body = await _read_limited(request, limit)
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


async def _read_limited(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        if declared > limit:
            raise APIError(
                413,
                f"the request body is {declared} bytes; this server accepts at most {limit}",
                code="request_too_large",
            )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413, f"the request body is over {limit} bytes, the most this server accepts", code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


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
                raise APIError(
                    400,
                    f"{where} is not valid Unicode: lone surrogate at position {e.start}",
                    param=p.split("[")[0].split(".")[0] or None,
                ) from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, f"{path} key" if not p else f"{p} key"))
                stack.append((item, f"{p}.{k}" if p else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in enumerate(v))


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


# ---- scalar fields ------------------------------------------------------------------------------
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


# ---- the fields of a request --------------------------------------------------------------------
def reject_unsupported(body: dict, chat: bool) -> None:
    """400 for knobs this server cannot honour (silence would lie) and for a non-string model/user."""
    for name in ("presence_penalty", "frequency_penalty"):
        if opt_number(body, name, 0.0, -2.0, 2.0) != 0:
            raise _unsupported(name, "is not supported by this server; leave it out or send 0")
    if body.get("logit_bias") not in (None, {}):
        raise _unsupported("logit_bias")
    _reject_unsupported_chat(body) if chat else _reject_unsupported_completion(body)
    for name in ("user", "model"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise _bad_type(name, "a string", value)


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{name}' {why}", param=name)


def _reject_unsupported_chat(body: dict) -> None:
    if body.get("logprobs") not in (None, False):
        raise _unsupported("logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise _unsupported(name, "(tool calling) is not supported by this server")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _unsupported("tool_choice", "(tool calling) is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", 'is not supported by this server: only {"type": "text"}')


def _reject_unsupported_completion(body: dict) -> None:
    if body.get("logprobs") not in (None, 0):
        raise _unsupported("logprobs")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix")


def parse_stream(body: dict) -> StreamOptions:
    stream = opt_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return StreamOptions(stream=stream)
    if not isinstance(opts, dict):
        raise _bad_type("stream_options", "an object", opts)
    if not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include = opts.get("include_usage")
    continuous = opts.get("continuous_usage_stats")
    for name, value in (("include_usage", include), ("continuous_usage_stats", continuous)):
        if value is not None and not isinstance(value, bool):
            raise _bad_type(f"stream_options.{name}", "a boolean", value)
    return StreamOptions(stream=stream, include_usage=bool(include), continuous_usage=bool(continuous))


def parse_messages(value) -> list[ChatMessage]:
    if value is None:
        raise APIError(
            400, '\'messages\' is required: a non-empty array of {"role", "content"} objects', param="messages"
        )
    if not isinstance(value, list):
        raise _bad_type("messages", 'an array of {"role", "content"} objects', value)
    if not value:
        raise APIError(400, "'messages' must not be empty", param="messages")
    return [_parse_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _parse_message(m, where: str) -> ChatMessage:
    if not isinstance(m, dict):
        raise _bad_type(where, "an object with 'role' and 'content'", m)
    role = m.get("role")
    if not isinstance(role, str):
        raise APIError(400, f"{where}.role must be a string (system, developer, user or assistant)", param="messages")
    if role not in ROLE_ALIASES:
        raise APIError(
            400, f"{where}.role must be one of system, developer, user, assistant; got {role!r}", param="messages"
        )
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    elif content is None:
        raise APIError(400, f"{where}.content is missing or null (tool calls are not supported)", param="messages")
    elif not isinstance(content, str):
        raise _bad_type(f"{where}.content", "a string or an array of text parts", content)
    return ChatMessage(role=ROLE_ALIASES[role], content=content)


def _text_part(part, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise APIError(
            400, f'{where}: only text parts {{"type": "text", "text": "..."}} are supported', param="messages"
        )
    return part["text"]


def parse_prompt(value) -> str | list[int]:
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
            raise APIError(
                400,
                f"'prompt' holds {len(value)} prompts; this server takes one prompt per "
                "request (send several requests, or use 'n' for several samples)",
                param="prompt",
            )
        if any(isinstance(t, bool) or not isinstance(t, int) for t in value):
            raise APIError(400, "'prompt' as an array must hold integer token ids only", param="prompt")
        return value
    raise _bad_type("prompt", "a string or an array of token ids", value)


def parse_sampling(body: dict, limits: Limits) -> Sampling:
    """max_completion_tokens wins over max_tokens (both are type-checked)."""
    max_tokens = opt_int(body, "max_completion_tokens", None, 1, limits.max_tokens)
    legacy = opt_int(body, "max_tokens", None, 1, limits.max_tokens)
    n = opt_int(body, "n", 1, 1, limits.max_n)
    best_of = opt_int(body, "best_of", None, 1, limits.max_n)
    if best_of is not None and best_of != n:
        raise APIError(400, "'best_of' other than n is not supported by this server", param="best_of")
    top_k = opt_int(body, "top_k", 0, -1, 1 << 30)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (
        not isinstance(stop_token_ids, list)
        or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_token_ids)
    ):
        raise _bad_type("stop_token_ids", "an array of non-negative integers", stop_token_ids)
    return Sampling(
        n=n,
        temperature=opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        max_tokens=max_tokens if max_tokens is not None else legacy,
        seed=opt_int(body, "seed", None, 0, 2**63 - 1),
        stop=parse_stop(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=opt_bool(body, "ignore_eos"),
    )


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
            raise APIError(
                400, f"'stop' must be a string or an array of strings; it holds a {_json_type(s)}", param="stop"
            )
    if len(stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(
            400,
            f"'stop' must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
    return stop
