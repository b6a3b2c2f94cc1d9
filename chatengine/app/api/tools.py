"""Tool calling, as OpenAI's chat completions API has it: the request's `tools`, `tool_choice`,
`parallel_tool_calls` (and the legacy `functions` / `function_call`), tool-call and tool-result
messages, how they reach the model's chat template, and the model's text turned back into
`tool_calls`, whole or streamed.

- **Rendering.** A template that reads `tools` renders the definitions, assistant `tool_calls` and
  "tool" messages itself. A template without tool support (the default SmolLM2-135M's) never sees
  the definitions: the request is answered as a plain chat and the response says so in the header
  `X-Chatengine-Tools: ignored`; tool calls and results in the history become text
  (`<tool_call>` / `<tool_response>`, Hermes style). When `tool_choice` demands a call ("required" or
  a named function), the definitions go into the system message, Hermes style, instead.
- **Forced calls.** "required" and a named function are decoded under a JSON schema (the engine's
  structured outputs): `{"name": <one of the tools>, "arguments": <its parameters>}`, an array of
  them for "required" with parallel tool calls, so the call is always valid JSON for a known tool.
- **Parsers, per model family** (chosen from the template): Hermes `<tool_call>{...}</tool_call>`
  (Qwen2.5/Qwen3, Hermes, SmolLM3, and our own fallback), Llama 3 JSON (`{"name", "parameters"}`,
  optionally after `<|python_tag|>`). A call with an unknown name or JSON that does not parse stays in
  the content, as the model wrote it.
- **Streaming.** Text before a call streams as content; text that may be the start of a call's
  marker is held back until it is known. A call is sent once it is complete (its closing marker, or
  the end of its JSON): one delta with its index, id, type and name, then its arguments. The parser
  that streams is the one that answers whole responses (fed all the text at once), so both give
  the same calls and content.
"""

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from chatengine import StructuredOutputs
from chatengine.app.api.protocol import APIError, Limits

MAX_TOOLS = 128
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOL_CALLS_IN_MESSAGE = 128
TOOLS_HEADER = "X-Chatengine-Tools"
CHOICES = ("none", "auto", "required")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


# ---- the request --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolRequest:
    """The tools of a chat request: definitions normalized to OpenAI's `{"type": "function",
    "function": {"name", "description", "parameters"}}`; choice "none" | "auto" | "required" |
    "named" (then `named` is the function's name)."""

    tools: tuple = ()
    choice: str = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named") and bool(self.tools)

    @property
    def active(self) -> bool:
        """Whether the model is offered tools at all."""
        return self.choice != "none" and bool(self.tools)

    def schema(self) -> dict:
        """The JSON schema a forced call is decoded under."""
        functions = [t["function"] for t in self.tools if self.choice != "named" or t["function"]["name"] == self.named]
        defs: dict = {}
        options = []
        for f in functions:
            params = dict(f.get("parameters") or {"type": "object"})
            for key in ("$defs", "definitions"):  # references point at the root: hoist them there
                if isinstance(params.get(key), dict):
                    defs.setdefault(key, {}).update(params.pop(key))
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [f["name"]]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        one = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {"type": "array", "items": one, "minItems": 1} if self.choice == "required" and self.parallel else one
        return {**schema, **defs}


def parse_tools(body: dict, limits: Limits) -> ToolRequest | None:
    """The request's tools and tool_choice (or the legacy functions / function_call), or None when
    it names none. 400 for a bad definition, name or choice; the definitions' text counts against
    the prompt's character cap (checked before anything is tokenized)."""
    tools, functions = body.get("tools"), body.get("functions")
    choice, legacy_choice = body.get("tool_choice"), body.get("function_call")
    if tools is not None and functions is not None:
        raise APIError(400, "give 'tools' or the legacy 'functions', not both", param="functions")
    if choice is not None and legacy_choice is not None:
        raise APIError(400, "give 'tool_choice' or the legacy 'function_call', not both", param="function_call")
    param = "functions" if functions is not None else "tools"
    if functions is not None:
        if not isinstance(functions, list):
            raise APIError(400, "'functions' must be an array of function definitions", param="functions")
        tools = [{"type": "function", "function": f} for f in functions]
    choice_param = "function_call" if legacy_choice is not None else "tool_choice"
    if legacy_choice is not None:
        choice = {"type": "function", "function": legacy_choice} if isinstance(legacy_choice, dict) else legacy_choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None and choice is None and parallel is None:
        return None
    defs = _parse_definitions(tools, param)
    chars = len(json.dumps(defs, ensure_ascii=False))
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise APIError(
            400,
            f"the '{param}' definitions hold {chars} characters; this model reads at most {limits.max_model_len} "
            f"tokens (about {limits.max_prompt_chars} characters): send fewer or shorter tools",
            param=param,
            code="context_length_exceeded",
        )
    kind, named = _parse_choice(choice, choice_param, {d["function"]["name"] for d in defs})
    if kind in ("required", "named") and not defs:
        raise APIError(400, f"'{choice_param}' {kind!r} needs at least one tool in '{param}'", param=choice_param)
    return ToolRequest(tuple(defs), kind, named, True if parallel is None else parallel)


def _parse_definitions(tools, param: str) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, f"'{param}' must be an array of tool definitions", param=param)
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'{param}' holds {len(tools)} tools; at most {MAX_TOOLS} are allowed", param=param)
    defs, seen = [], set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(
                400, f'{where} must be {{"type": "function", "function": {{"name", "parameters", ...}}}}', param=param
            )
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise APIError(
                400,
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes; got {name!r}",
                param=param,
            )
        if name in seen:
            raise APIError(400, f"{where}.function.name {name!r} is defined twice", param=param)
        seen.add(name)
        description = f.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"{where}.function.description must be a string", param=param)
        parameters = f.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param=param)
        if f.get("strict") is not None and not isinstance(f.get("strict"), bool):
            raise APIError(400, f"{where}.function.strict must be a boolean", param=param)
        fn: dict = {"name": name}
        if description is not None:
            fn["description"] = description
        fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
        defs.append({"type": "function", "function": fn})
    return defs


def _parse_choice(choice, param: str, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise APIError(400, f"'{param}' must be none, auto, required or a function; got {choice!r}", param=param)
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
        raise APIError(
            400,
            f'\'{param}\' must be none, auto, required or {{"type": "function", "function": {{"name": "..."}}}}',
            param=param,
        )
    if fn["name"] not in names:
        known = ", ".join(sorted(names)) or "none"
        raise APIError(400, f"'{param}' names {fn['name']!r}, which is not among the tools ({known})", param=param)
    return "named", fn["name"]


def check_tool_text(tools: ToolRequest | None, messages: list, limits: Limits) -> None:
    """The text of the tool calls in the history counts against the prompt's cap, with the rest."""
    if limits.max_prompt_chars is None:
        return
    chars = sum(len(m.content) for m in messages) + sum(
        len(json.dumps(m.tool_calls, ensure_ascii=False)) for m in messages if m.tool_calls
    )
    if tools is not None:
        chars += len(json.dumps(list(tools.tools), ensure_ascii=False))
    if chars > limits.max_prompt_chars:
        raise APIError(
            400,
            f"the messages and tools hold {chars} characters; this model reads at most {limits.max_model_len} tokens "
            f"(about {limits.max_prompt_chars} characters): shorten the input",
            param="messages",
            code="context_length_exceeded",
        )


def force_sampling(sampling, tools: ToolRequest | None):
    """The request's sampling with the forced call's schema, when tool_choice demands a call."""
    if tools is None or not tools.forced:
        return sampling
    if sampling.structured is not None:
        raise APIError(
            400,
            f"give one output constraint: tool_choice {tools.choice!r} cannot be combined with "
            f"'{sampling.structured_param}'",
            param=sampling.structured_param,
        )
    return sampling.model_copy(
        update={"structured": StructuredOutputs(json=tools.schema()), "structured_param": "tool_choice"}
    )


# ---- messages -----------------------------------------------------------------------------------
def parse_tool_message(m: dict, where: str, text_part) -> dict:
    """The fields of a tool result ("tool", with `tool_call_id`) or of an assistant message with
    `tool_calls` (content may be null), for ChatMessage."""
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    if content is not None and not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string, an array of text parts or null", param="messages")
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise APIError(
                400,
                f"{where}.tool_call_id must be a string: a message of role 'tool' answers a call by its id",
                param="messages",
            )
        if content is None:
            raise APIError(400, f"{where}.content is missing or null (a tool's result)", param="messages")
        return {"role": "tool", "content": content, "tool_call_id": call_id}
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_IN_MESSAGE:
        raise APIError(
            400, f"{where}.tool_calls must be an array of at most {MAX_TOOL_CALLS_IN_MESSAGE} calls", param="messages"
        )
    parsed = []
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise APIError(
                400,
                f'{w} must be {{"id", "type": "function", "function": {{"name", "arguments": "<JSON text>"}}}}',
                param="messages",
            )
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(400, f"{w}.id must be a string", param="messages")
        parsed.append(
            {
                "id": call_id or new_call_id(),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return {"role": "assistant", "content": content or "", "tool_calls": parsed}


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


# ---- rendering ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCalling:
    """How one chat request uses tools: the parser of its output (None: the output is plain text),
    the names a call may use, and whether the tools were ignored (no template support)."""

    parser: str | None = None  # "hermes" | "llama3" | "json" (a forced call: the whole output)
    names: frozenset = frozenset()
    ignored: bool = False
    parallel: bool = True  # parallel_tool_calls false: calls after the first are dropped (as vLLM)

    @property
    def headers(self) -> dict:
        return {TOOLS_HEADER: "ignored"} if self.ignored else {}

    def stream(self) -> "ToolStream":
        return ToolStream(self.parser or "none", self.names, self.parallel)


def template_family(template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    if template and ("<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template)):
        return "llama3"
    return "hermes"


def plan(engine, tools: ToolRequest | None) -> ToolCalling | None:
    """What the request's tools mean for the prompt and the output (None: no tools asked for)."""
    if tools is None:
        return None
    if tools.forced:
        return ToolCalling("json", tools.names, parallel=tools.parallel)
    if not tools.active:
        return ToolCalling()
    if not engine.supports_tools:
        return ToolCalling(ignored=True)
    return ToolCalling(template_family(engine.chat_template), tools.names, parallel=tools.parallel)


def template_args(engine, messages: list[dict], tools: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the engine's apply_chat_template: OpenAI messages (as ChatMessage dumps)
    in the form the model's template reads, or as text when it cannot render tools."""
    supports = engine.supports_tools
    has_tool_messages = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if tools is None and not has_tool_messages:
        return [_plain(m) for m in messages], None
    if supports:
        out = _template_messages(messages)
        render = tools is not None and tools.active
        return out, [dict(t) for t in tools.tools] if render else None
    out = _text_messages(messages)
    if tools is not None and tools.forced:
        out = _with_hermes_system(out, tools)
    return out, None


def _plain(m: dict) -> dict:
    return {"role": m["role"], "content": m["content"]}


def _arguments(text: str):
    """A call's arguments as the template wants them: the object its JSON text holds (templates
    apply tojson), or the text itself when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _template_messages(messages: list[dict]) -> list[dict]:
    names: dict[str, str] = {}
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                fn = {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                calls.append({"id": c["id"], "type": "function", "function": fn})
            out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
        elif m["role"] == "tool":
            tool_msg = {"role": "tool", "content": m["content"], "tool_call_id": m["tool_call_id"]}
            if m["tool_call_id"] in names:
                tool_msg["name"] = names[m["tool_call_id"]]
            out.append(tool_msg)
        else:
            out.append(_plain(m))
    return out


def hermes_call_text(name: str, arguments) -> str:
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{HERMES_CLOSE}"


def _text_messages(messages: list[dict]) -> list[dict]:
    """Tool calls and results as text, for a template that knows only system, user and assistant:
    calls in the assistant's content (Hermes `<tool_call>`), consecutive results in one user turn
    (`<tool_response>`)."""
    out: list[dict] = []
    previous_tool = False
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                hermes_call_text(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous_tool:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append(_plain(m))
        previous_tool = m["role"] == "tool"
    return out


def _with_hermes_system(messages: list[dict], tools: ToolRequest) -> list[dict]:
    """The tool definitions in the system message, as Hermes-style templates put them."""
    defs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
    which = f"the function {tools.named}" if tools.choice == "named" else "one or more of these functions"
    text = (
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
        f"XML tags:\n<tools>\n{defs}\n</tools>\nCall {which} to answer: reply with a JSON object "
        '{"name": <function-name>, "arguments": <args-json-object>} for each call.'
    )
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- the output ---------------------------------------------------------------------------------
@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _as_call(obj, names: frozenset) -> ToolCall | None:
    """A call from a parsed JSON object: {"name", "arguments" | "parameters"} naming a known tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _decode(text: str, at: int):
    """(value, end) of the JSON value at `at`, or None when it is incomplete or invalid."""
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolStream:
    """Turns a completion's text, fed in pieces, into content and tool calls. feed() returns what
    is known so far; finish() the rest. Events are ("content", text) and ("call", ToolCall). Feeding
    the text in any pieces gives the same events, merged."""

    def __init__(self, parser: str, names: frozenset, parallel: bool = True):
        self.parser, self.names, self.parallel = parser, names, parallel
        self.buf = ""
        self.in_call = False  # hermes: inside <tool_call>
        self.mode = "start"  # llama3 / json: "start" (calls may come), "text" (plain text from here)
        self.calls: list[ToolCall] = []
        self.pending_ws = ""  # trailing whitespace of the content: dropped before a call
        self.after_call = False
        self.array = False  # json: inside the array of a parallel forced call
        self.prefix = ""  # json: the array's "[" read before its first call (text again if none comes)

    # events
    def _content(self, text: str, out: list) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.pending_ws + text
        stripped = text.rstrip()
        self.pending_ws = text[len(stripped) :]
        if stripped:
            out.append(("content", stripped))

    def _call(self, call: ToolCall, out: list) -> None:
        self.pending_ws, self.after_call = "", True
        if self.calls and not self.parallel:
            return  # at most one call was asked for
        self.calls.append(call)
        out.append(("call", call))

    def feed(self, text: str) -> list:
        out: list = []
        self.buf += text
        if self.parser == "none":
            self._content(self.buf, out)
            self.buf = ""
        elif self.parser == "hermes":
            self._hermes(out, final=False)
        else:
            self._json(out, final=False)
        return out

    def finish(self) -> list:
        out: list = []
        if self.parser == "hermes":
            self._hermes(out, final=True)
        elif self.parser in ("llama3", "json"):
            self._json(out, final=True)
        if self.buf:
            self._content(self.buf, out)
            self.buf = ""
        if self.pending_ws and not self.calls:
            out.append(("content", self.pending_ws))
        self.pending_ws = ""
        return out

    def _hermes(self, out: list, final: bool) -> None:
        while True:
            if not self.in_call:
                at = self.buf.find(HERMES_OPEN)
                if at < 0:
                    keep = 0 if final else _held_prefix(self.buf, HERMES_OPEN)
                    if len(self.buf) > keep:
                        self._content(self.buf[: len(self.buf) - keep], out)
                        self.buf = self.buf[len(self.buf) - keep :]
                    return
                if at:
                    self._content(self.buf[:at], out)
                self.buf, self.in_call = self.buf[at + len(HERMES_OPEN) :], True
                continue
            end = self.buf.find(HERMES_CLOSE)
            if end < 0 and not final:
                return
            block = self.buf if end < 0 else self.buf[:end]
            rest = "" if end < 0 else self.buf[end + len(HERMES_CLOSE) :]
            decoded = _decode(block, len(block) - len(block.lstrip()))
            call = _as_call(decoded[0], self.names) if decoded and not block[decoded[1] :].strip() else None
            if call is not None:
                self._call(call, out)
            else:  # left as the model wrote it
                self._content(HERMES_OPEN + block + (HERMES_CLOSE if end >= 0 else ""), out)
            self.buf, self.in_call = rest, False
            if end < 0:
                return

    def _json(self, out: list, final: bool) -> None:
        """Llama 3 (calls first, as JSON objects after an optional <|python_tag|>, separated by ";"
        or whitespace) and forced calls (the whole output: one object, or an array of them, each
        element a call as soon as it is complete)."""
        while self.mode == "start":
            s = self.buf.lstrip()
            if self.parser == "llama3" and s.startswith(PYTHON_TAG):
                s = s[len(PYTHON_TAG) :].lstrip()
            separator = ";" if self.parser == "llama3" else "," if self.array else None
            if self.calls and separator and s[:1] == separator:
                s = s[1:].lstrip()
            if not s:
                if final:
                    self._to_text(s)
                break
            if not final and self.parser == "llama3" and PYTHON_TAG.startswith(s):
                break
            if self.parser == "json" and s[0] == "[" and not self.calls and not self.array:
                self.array, self.prefix = True, self.buf[: len(self.buf) - len(s) + 1]
                self.buf = s[1:]
                continue
            if self.array and s[0] == "]":
                self.array = False
                self._to_text(s[1:])
                break
            if s[0] != "{":
                self._to_text(s)
                break
            decoded = _decode(s, 0)
            if decoded is None:
                if final:
                    self._to_text(s)
                break
            call = _as_call(decoded[0], self.names)
            if call is None:
                self._to_text(s)
                break
            self._call(call, out)
            self.buf, self.prefix = s[decoded[1] :], ""
            if self.parser == "json" and not self.array:  # a forced call is one object
                self._to_text(self.buf)
                break
        if self.mode == "text" and self.buf:
            self._content(self.buf, out)
            self.buf = ""

    def _to_text(self, rest: str) -> None:
        """Plain text from here on: after a call, `rest` (the text past it and its separator); before
        any, all of it (with what was read as the start of an array)."""
        self.mode = "text"
        self.buf = rest if self.calls else self.prefix + self.buf
        self.prefix = ""


def parse_output(calling: ToolCalling | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole completion's text."""
    if calling is None or calling.parser is None:
        return text, []
    stream = calling.stream()
    events = stream.feed(text) + stream.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content or None) if stream.calls else content, stream.calls


def finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def assistant_message(calling: ToolCalling | None, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The message of one choice of a whole response, and its finish_reason."""
    content, calls = parse_output(calling, text)
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message, finish_reason(reason, calls)


def stream_deltas(stream: ToolStream, text: str, finished: bool) -> list[dict]:
    """The chat deltas for `text` newly generated (and the end, when finished): content, and each
    complete call as a delta with its name, then one with its arguments (OpenAI's order)."""
    events = stream.feed(text) + (stream.finish() if finished else [])
    deltas: list[dict] = []
    for kind, value in events:
        if kind == "content":
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += value
            else:
                deltas.append({"content": value})
        else:
            index = next(k for k, c in enumerate(stream.calls) if c is value)
            head = {
                "index": index,
                "id": value.id,
                "type": "function",
                "function": {"name": value.name, "arguments": ""},
            }
            deltas.append({"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": value.arguments}}]})
    return deltas
