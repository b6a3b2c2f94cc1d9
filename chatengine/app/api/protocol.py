"""The OpenAI wire protocol, request side: reading and validating a body into a request model.

Validation is by hand, field by field, so that every message names the field and says what was wrong
in words a client's author can act on (pydantic's own messages and status would differ from the ones
this API promises). What passes lands in the pydantic models below, which are the typed request the
routes work with. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from chatengine import SamplingParams, StructuredOutputs

Kind = Literal["chat", "completion"]  # the two routes: /v1/chat/completions, /v1/completions
Role = Literal["system", "user", "assistant", "tool"]
ROLE_ALIASES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_PROMPTS = 64  # prompts in one completions request (each counts as a request for the rate limit)
MAX_LOGPROBS = 20  # top candidates per token: OpenAI allows 20 on chat (5 on completions; vLLM 20)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI, vLLM and SGLang
STRUCTURED_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


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
    tool_calls: list[dict] | None = None  # an assistant's calls (its content may be ""): see tools.py
    tool_call_id: str | None = None  # role "tool": the call this result answers


class StreamOptions(_Model):
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats (with include_usage): usage in every chunk


class Sampling(_Model):
    """The sampling fields of a request; max_tokens None: as long as the context and limits allow (at
    most default_max_tokens when set); max_tokens 0 (completions with echo): the prompt alone."""

    model_config = ConfigDict(strict=True, frozen=True, arbitrary_types_allowed=True)

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None  # top candidates shown per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions with echo)
    echo: bool = False  # completions: the prompt is sent back before the completion
    structured: StructuredOutputs | None = None
    structured_param: str | None = None  # the request field `structured` came from (named in errors)


class CompletionRequest(_Model):
    """One request of either route: `messages` for chat, `prompts` (each text or token ids) for
    completions; `prompt` is the prompt when there is exactly one."""

    kind: Kind
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    prompts: list[str | list[int]] | None = None
    stream: StreamOptions = StreamOptions()
    sampling: Sampling = Sampling()
    tools: Any = None  # chat: the ToolRequest of tools.py, None when the request names no tools


@dataclass(frozen=True)
class Limits:
    """What the engine allows, read once from it; default_max_tokens is the server's own cap."""

    max_n: int
    max_tokens: int
    max_model_len: int
    kv_capacity_tokens: int
    default_max_tokens: int | None = None
    max_prompt_chars: int | None = None  # longer prompt text is refused before tokenizing
    vocab_size: int | None = None  # token ids (stop_token_ids, logit_bias keys) must be below it
    # the model's own sampling defaults (its generation_config.json): what a request that names no
    # temperature / top_p / top_k / repetition_penalty gets, and a chat reply's cap without max_tokens
    generation_defaults: dict = field(default_factory=dict)

    @classmethod
    def of(cls, engine, default_max_tokens: int | None = None) -> "Limits":
        return cls(
            engine.max_n,
            engine.max_tokens_limit,
            engine.max_model_len,
            engine.kv_capacity_tokens,
            default_max_tokens,
            engine.max_prompt_chars,
            engine.vocab_size,
            dict(getattr(engine, "generation_defaults", None) or {}),
        )


def parse_request(kind: Kind, body: dict, limits: Limits) -> CompletionRequest:
    """The request model of a JSON body, or the APIError (400) of its first bad field."""
    chat = kind == "chat"
    reject_unsupported(body, chat=chat)
    stream = parse_stream(body)
    tool_request = None
    if chat:
        from chatengine.app.api import tools

        messages, prompts = parse_messages(body.get("messages")), None
        tool_request = tools.parse_tools(body, limits)
        tools.check_tool_text(tool_request, messages, limits)
    else:
        messages, prompts = None, parse_prompts(body.get("prompt"))
    check_text_length(messages, prompts, limits)
    sampling = parse_sampling(body, limits, kind)
    return CompletionRequest(
        kind=kind,
        messages=messages,
        prompt=prompts[0] if prompts is not None and len(prompts) == 1 else None,
        prompts=prompts,
        stream=stream,
        sampling=tools.force_sampling(sampling, tool_request) if chat else sampling,
        tools=tool_request,
    )


def check_text_length(messages: list[ChatMessage] | None, prompts: list | None, limits: Limits) -> None:
    """Refuse text that cannot fit the context before the tokenizer spends time on it (each prompt
    on its own: several prompts are several requests, and the body's size caps their sum)."""
    if limits.max_prompt_chars is None:
        return
    if messages is not None:
        texts = [("messages", sum(len(m.content) for m in messages))]
    else:  # token ids: their count is checked against the context as it is
        many = len(prompts or ()) > 1
        texts = [
            (f"prompt[{k}]" if many else "prompt", len(p)) for k, p in enumerate(prompts or ()) if isinstance(p, str)
        ]
    for what, chars in texts:
        if chars > limits.max_prompt_chars:
            raise APIError(
                400,
                f"the {what} {'holds' if what.startswith('prompt[') else 'hold'} {chars} characters; this model reads "
                f"at most "
                f"{limits.max_model_len} tokens (about {limits.max_prompt_chars} characters): shorten the input",
                param="messages" if messages is not None else "prompt",
                code="context_length_exceeded",
            )


def sampling_params(sampling: Sampling, prompt_len: int, limits: Limits) -> SamplingParams:
    """The engine's SamplingParams. Without max_tokens the completion may fill the context, capped by
    the engine's max_tokens limit, the KV pool, the server's default_max_tokens and the request's
    default (completions: 16). An explicit max_tokens that does not fit after the prompt is a 400
    naming both numbers (OpenAI and vLLM), never silently clamped. max_tokens 0 (echo) asks the
    engine for one token, which the response drops (as vLLM)."""
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        room = limits.max_model_len - prompt_len
        pool = limits.kv_capacity_tokens - prompt_len
        caps = (sampling.default_max_tokens, limits.default_max_tokens, limits.max_tokens)
        max_tokens = max(1, min(room, pool, *(c for c in caps if c)))
    else:
        if prompt_len < limits.max_model_len < prompt_len + max_tokens:
            raise APIError(
                400,
                f"this model's context is {limits.max_model_len} tokens, but {prompt_len + max_tokens} were asked for "
                f"({prompt_len} in the prompt, {max_tokens} in max_tokens): lower max_tokens to at most "
                f"{limits.max_model_len - prompt_len} or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = max(max_tokens, 1)
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
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias) if sampling.logit_bias else None,
        min_tokens=min(sampling.min_tokens, max_tokens),
        structured_outputs=sampling.structured,
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
        # strict UTF-8 (a BOM allowed), decoded here: json.loads of bytes would also guess UTF-16 or
        # UTF-32 and let encoded surrogates through ('surrogatepass')
        data = json.loads(body.decode("utf-8-sig"), parse_constant=no_constants)
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
    if _may_hold_surrogates(body):
        _check_unicode(data, "")
    return data


# a \u escape of a UTF-16 surrogate (D800-DFFF); a pair of them is one valid character, a lone one is not
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(body: bytes) -> bool:
    """Whether the body, strict UTF-8 (read_json_body decodes it so), can hold a lone surrogate once
    parsed: only through a \\u escape of one. The walk over every value (a token-id prompt is
    thousands of them) runs only then."""
    return _SURROGATE_ESCAPE.search(body) is not None


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
    if not chat:  # chat serves tools, tool_choice and the legacy functions (tools.py)
        _reject_unsupported_completion(body)
    for name in ("user", "model"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise _bad_type(name, "a string", value)


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{name}' {why}", param=name)


def _reject_unsupported_completion(body: dict) -> None:
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
    # as vLLM: continuous_usage_stats only adds to include_usage
    return StreamOptions(stream=stream, include_usage=bool(include), continuous_usage=bool(include and continuous))


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
    if role == "tool" or (role == "assistant" and m.get("tool_calls") is not None):
        from chatengine.app.api.tools import parse_tool_message

        return ChatMessage(**parse_tool_message(m, where, _text_part))
    if not isinstance(role, str):
        raise APIError(400, f"{where}.role must be a string (system, developer, user or assistant)", param="messages")
    if role not in ROLE_ALIASES:
        raise APIError(
            400, f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}", param="messages"
        )
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    elif content is None:
        raise APIError(400, f"{where}.content is missing or null", param="messages")
    elif not isinstance(content, str):
        raise _bad_type(f"{where}.content", "a string or an array of text parts", content)
    return ChatMessage(role=ROLE_ALIASES[role], content=content)


def _text_part(part, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise APIError(
            400, f'{where}: only text parts {{"type": "text", "text": "..."}} are supported', param="messages"
        )
    return part["text"]


def parse_prompts(value) -> list[str | list[int]]:
    """The prompts of a completions request: a string, an array of token ids, or an array of up to
    MAX_PROMPTS of either (OpenAI's batch form)."""
    if value is None:
        raise APIError(400, "'prompt' is required: a string or an array of token ids", param="prompt")
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise APIError(
                400,
                f"'prompt' holds {len(value)} prompts; this server takes at most {MAX_PROMPTS} in one request",
                param="prompt",
            )
        return [_one_prompt(v, f"prompt[{k}]" if len(value) > 1 else "prompt") for k, v in enumerate(value)]
    return [_one_prompt(value, "prompt")]


def _one_prompt(value, where: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise APIError(400, f"'{where}' is empty", param="prompt")
        return value
    if isinstance(value, list):
        if not value:
            raise APIError(400, f"'{where}' is empty", param="prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in value):
            raise APIError(
                400,
                f"'{where}' as an array must hold integer token ids only (or be an array of prompts: "
                "strings or arrays of token ids)",
                param="prompt",
            )
        return value
    raise _bad_type(where, "a string or an array of token ids", value)


def parse_sampling(body: dict, limits: Limits, kind: Kind = "chat") -> Sampling:
    """max_completion_tokens wins over max_tokens (both are type-checked). Completions default to 16
    tokens and take max_tokens 0 with echo (the prompt alone, for its logprobs), as OpenAI and vLLM."""
    chat = kind == "chat"
    echo = False if chat else opt_bool(body, "echo")
    max_tokens = opt_int(body, "max_completion_tokens", None, 1, limits.max_tokens)
    legacy = opt_int(body, "max_tokens", None, 0 if echo else 1, limits.max_tokens)
    max_tokens = max_tokens if max_tokens is not None else legacy
    n = opt_int(body, "n", 1, 1, limits.max_n)
    best_of = opt_int(body, "best_of", None, 1, limits.max_n)
    if best_of is not None and best_of != n:
        raise APIError(400, "'best_of' other than n is not supported by this server", param="best_of")
    top_k = opt_int(body, "top_k", limits.generation_defaults.get("top_k", 0), -1, 1 << 30)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (
        not isinstance(stop_token_ids, list)
        or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_token_ids)
    ):
        raise _bad_type("stop_token_ids", "an array of non-negative integers", stop_token_ids)
    vocab = limits.vocab_size
    if stop_token_ids and vocab is not None and max(stop_token_ids) >= vocab:
        bad = [t for t in stop_token_ids if t >= vocab][:5]
        raise APIError(
            400,
            f"'stop_token_ids' must be token ids in [0, {vocab}) (the model's vocabulary); got {bad}",
            param="stop_token_ids",
        )
    seed = opt_int(body, "seed", None, -(2**63), 2**63 - 1)
    min_tokens = opt_int(body, "min_tokens", 0, 0, limits.max_tokens)
    if max_tokens is not None and min_tokens > max(max_tokens, 1):
        raise APIError(
            400, f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )
    logprobs, prompt_logprobs = parse_logprobs(body, chat, echo)
    structured, structured_param = parse_structured(body)
    model = limits.generation_defaults  # what the model's own generation config sets, for absent fields
    return Sampling(
        n=n,
        temperature=opt_number(body, "temperature", model.get("temperature", 1.0), 0.0, 2.0),
        top_p=opt_number(body, "top_p", model.get("top_p", 1.0), 0.0, 1.0, lo_open=True),
        top_k=top_k,
        max_tokens=max_tokens,
        default_max_tokens=model.get("max_tokens") if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
        seed=None if seed is None else seed % 2**63,  # any int64, as OpenAI: negative ones map into the engine's range
        stop=parse_stop(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=opt_bool(body, "ignore_eos"),
        presence_penalty=opt_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=opt_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=opt_number(body, "repetition_penalty", model.get("repetition_penalty", 1.0), 0.01, 10.0),
        logit_bias=parse_logit_bias(body, vocab),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        echo=echo,
        structured=structured,
        structured_param=structured_param,
    )


def parse_logprobs(body: dict, chat: bool, echo: bool) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs): the top candidates to report per generated / prompt token.
    Chat: `logprobs` true, with `top_logprobs` in [0, 20]; completions: `logprobs` in [0, 20] (OpenAI
    allows 5, vLLM 20), and with echo the prompt's tokens too."""
    if chat:
        wanted = opt_bool(body, "logprobs")
        top = opt_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top and not wanted:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None, None
    value = body.get("logprobs")
    if isinstance(value, bool):  # a chat-style boolean sent to completions: false is no logprobs
        if value:
            raise _bad_type("logprobs", f"an integer in [0, {MAX_LOGPROBS}] (completions)", value)
        return None, None
    k = opt_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    return k, k if echo and k is not None else None


def parse_logit_bias(body: dict, vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object of token ids (as strings) to a bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise _bad_type("logit_bias", 'an object of token ids to biases, e.g. {"50256": -100}', value)
    if len(value) > MAX_LOGIT_BIAS:
        raise APIError(
            400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}", param="logit_bias"
        )
    bias = {}
    top = vocab if vocab is not None else 2**63
    for key, b in value.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < top:
            raise APIError(400, f"'logit_bias' keys must be token ids in [0, {top}), got {key!r}", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise APIError(
                400,
                f"'logit_bias' values must be numbers in [-100, 100], got {b!r} for token {key}",
                param="logit_bias",
            )
        bias[token] = float(b)
    return bias


def parse_structured(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """The output constraint and the field it came from: `response_format` (json_object, json_schema),
    vLLM's `structured_outputs` {json, json_object, regex, choice, grammar}, or its older `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar`. At most one of them; the engine checks the
    schema, regex or grammar itself (a bad one is a 400 with its message)."""
    found: list[tuple[StructuredOutputs, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad_type("structured_outputs", "an object with one of " + ", ".join(STRUCTURED_FIELDS), so)
        unknown = sorted(k for k, v in so.items() if k not in STRUCTURED_FIELDS and v not in (None, False))
        if unknown:
            raise _unsupported(f"structured_outputs.{unknown[0]}")
        fields = {k: so[k] for k in STRUCTURED_FIELDS if so.get(k) not in (None, False)}
        if fields:
            found.append((_structured(fields, "structured_outputs"), "structured_outputs"))
    for name in ("json", "regex", "choice", "grammar"):
        value = body.get(f"guided_{name}")
        if value is not None:
            found.append((_structured({name: value}, f"guided_{name}"), f"guided_{name}"))
    if body.get("guided_json_object"):
        found.append((StructuredOutputs(json_object=True), "guided_json_object"))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise APIError(400, f"give one output constraint, not several ({names})", param=found[1][1])
    return found[0] if found else (None, None)


def _response_format(fmt) -> StructuredOutputs | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad_type("response_format", 'an object with a "type" (text, json_object or json_schema)', fmt)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise APIError(
            400,
            f"'response_format.type' must be text, json_object or json_schema; got {kind!r}",
            param="response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad_type("response_format.json_schema", 'an object {"name", "schema", "strict"}', spec)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(
            400, "'response_format.json_schema.schema' must be a JSON schema object", param="response_format"
        )
    return _structured({"json": schema}, "response_format")


def _structured(fields: dict, param: str) -> StructuredOutputs:
    """A StructuredOutputs with the shape checks of its own validate(), as a 400 naming `param`."""
    if len(fields) != 1:
        raise APIError(
            400, f"'{param}' needs exactly one of {', '.join(STRUCTURED_FIELDS)}; got {sorted(fields)}", param=param
        )
    spec = StructuredOutputs(**fields)
    try:
        spec.validate()
    except ValueError as e:
        raise APIError(400, f"'{param}': {e}", param=param) from None
    return spec


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
