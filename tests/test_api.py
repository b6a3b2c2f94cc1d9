"""The OpenAI-compatible API, driven by the real `openai` client (and httpx for raw bodies) against
uvicorn servers on loopback. One engine for the module; three apps on it: multi-user (API keys),
local single-user mode, and a rate-limited one."""

import json
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

openai = pytest.importorskip("openai")

from chatengine import AsyncLLM  # noqa: E402
from chatengine.app.api.protocol import (  # noqa: E402
    APIError,
    ChatMessage,
    Limits,
    StreamOptions,
    parse_request,
    sampling_params,
)
from chatengine.app.api.routes import build_api  # noqa: E402

MODEL = "smollm2-135m-instruct"
USERS = {
    "alice": {"password": "pw-a", "api_key": "sk-alice"},
    "bob": {"password": "pw-b", "api_key": "sk-bob"},
    "carol": {"api_key": "sk-carol"},
}


@dataclass
class API:
    """A served app (see the `serve` fixture) and openai clients for it."""

    url: str

    def client(self, key="sk-none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def servers(engine, serve):
    return {
        "multi": API(serve(build_api(engine, USERS, model_name=MODEL)).url),
        "local": API(serve(build_api(engine, None, model_name=MODEL)).url),
        "limited": API(serve(build_api(engine, USERS, model_name=MODEL, rate_limit_per_minute=2)).url),
    }


@pytest.fixture
def local(servers):
    return servers["local"]


@pytest.fixture
def multi(servers):
    return servers["multi"]


def used_blocks(engine) -> int:
    return engine.stats()["kv_blocks_used"]


def wait_idle(engine, timeout=5.0) -> float:
    """Seconds until no request is left and no KV block is in use; fails after `timeout`."""
    start = time.monotonic()
    while engine.engine.requests or used_blocks(engine):
        assert time.monotonic() - start < timeout, (
            f"still {used_blocks(engine)} blocks used, requests {list(engine.engine.requests)}"
        )
        time.sleep(0.05)
    return time.monotonic() - start


def hello(text="Say hello in three words."):
    return [{"role": "user", "content": text}]


# ---- happy paths --------------------------------------------------------------------------------
def test_health_and_models(local, multi):
    assert httpx.get(local.url + "/health").json() == {"status": "ok"}
    models = local.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert multi.client("sk-alice").models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        multi.client("sk-alice").models.retrieve("gpt-4o")


def test_chat_completion(local, engine):
    resp = local.client().chat.completions.create(
        model="any-name-is-tolerated", messages=hello(), max_tokens=8, temperature=0
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL  # the model actually served is named
    [choice] = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    wait_idle(engine)


def test_content_parts_and_developer_role(local):
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ]
    r = local.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None and r.usage.prompt_tokens > 0


def test_n2_and_stop_and_length(local):
    client = local.client()
    resp = client.chat.completions.create(
        model=MODEL,
        messages=hello("Count: one, two,"),
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 10  # summed over both choices
    # max_completion_tokens wins over max_tokens; a stop string ends with "stop" and is cut off
    resp = client.chat.completions.create(
        model=MODEL,
        messages=hello("Write the letter a ten times."),
        max_tokens=40,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert len(text) > 3
    stop = text[2:4]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)


def test_greedy_repeatable_and_cached_tokens(local):
    client = local.client()
    messages = hello("Name three colours of the rainbow, then three fruits, then three animals. " * 2)
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    # the repeat finds every full block of its prompt in the prefix cache, and says so
    assert b.usage.prompt_tokens_details.cached_tokens >= (b.usage.prompt_tokens - 1) // 16 * 16 - 16 > 0


def test_completions_text_and_token_ids(local, engine):
    client = local.client()
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    ids = engine.get_tokenizer().encode("The capital of France is", add_special_tokens=False)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens == len(ids)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        r.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_stream_chunk_structure_n2_with_usage(local):
    body = {
        "model": MODEL,
        "messages": hello("Tell me a fact."),
        "n": 2,
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", local.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    # first one role chunk per choice
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:2])
    # then chunks of one choice each, exactly one finish_reason per choice
    body_chunks, usage_chunk = chunks[2:-1], chunks[-1]
    assert all(len(c["choices"]) == 1 for c in body_chunks)
    finishes = [
        (c["choices"][0]["index"], c["choices"][0]["finish_reason"])
        for c in body_chunks
        if c["choices"][0]["finish_reason"] is not None
    ]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    for i in (0, 1):  # nothing after a choice's finish chunk
        mine = [c for c in body_chunks if c["choices"][0]["index"] == i]
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 12 and "cached_tokens" in usage["prompt_tokens_details"]


def test_stream_with_openai_client_reassembles(local):
    client = local.client()
    kwargs = dict(model=MODEL, messages=hello("Say something short."), max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt just ran


# ---- the protocol without HTTP ------------------------------------------------------------------
LIMITS = Limits(max_n=4, max_tokens=100, max_model_len=128, kv_capacity_tokens=96)


def test_parse_request_builds_the_request_model():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = parse_request(
        "chat",
        {
            "messages": [{"role": "developer", "content": parts}],
            "max_tokens": 5,
            "max_completion_tokens": 3,
            "top_k": -1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "unknown": 1,
        },
        LIMITS,
    )
    assert req.messages == [ChatMessage(role="system", content="a\nb")] and req.prompt is None
    assert req.stream == StreamOptions(stream=True, include_usage=True)
    params = sampling_params(req.sampling, 10, LIMITS)
    assert params.max_tokens == 3 and params.top_k == 0 and params.n == 1
    # completions without max_tokens: 16 (OpenAI's default), or less when the context is fuller
    req = parse_request("completion", {"prompt": [[1, 2]], "n": 2.0}, LIMITS)
    assert req.prompt == [1, 2] and req.sampling.n == 2
    assert sampling_params(req.sampling, 40, LIMITS).max_tokens == 16
    assert sampling_params(req.sampling, 85, LIMITS).max_tokens == 11  # the KV pool holds 96
    # chat without max_tokens: the room left in the context, the engine's limit and the KV pool, whichever is least
    req = parse_request("chat", {"messages": [{"role": "user", "content": "x"}]}, LIMITS)
    assert sampling_params(req.sampling, 40, LIMITS).max_tokens == 56
    assert sampling_params(req.sampling, 40, Limits(4, 100, 128, 96, default_max_tokens=8)).max_tokens == 8


def test_absent_sampling_fields_take_the_models_generation_defaults():
    """As vLLM's --generation-config: what the client leaves out comes from the model's
    generation_config.json; what it sends wins; a chat reply without max_tokens stops at the
    model's max_new_tokens (or the server's cap, the lower); completions keep OpenAI's 16."""
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 30}
    limits = Limits(4, 100, 128, 96, generation_defaults=model)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    p = sampling_params(parse_request("chat", chat, limits).sampling, 10, limits)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.95, 20, 1.1, 30)
    sent = {**chat, "temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1, "max_tokens": 50}
    p = sampling_params(parse_request("chat", sent, limits).sampling, 10, limits)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.0, 1.0, 0, 1.0, 50)
    capped = Limits(4, 100, 128, 96, default_max_tokens=12, generation_defaults=model)
    assert sampling_params(parse_request("chat", chat, capped).sampling, 10, capped).max_tokens == 12
    p = sampling_params(parse_request("completion", {"prompt": "x"}, limits).sampling, 10, limits)
    assert p.max_tokens == 16 and p.temperature == 0.6
    plain = Limits(4, 100, 128, 96)  # a model without a generation config: OpenAI's defaults
    p = sampling_params(parse_request("chat", chat, plain).sampling, 10, plain)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)


@pytest.mark.parametrize(
    "kind,body,param",
    [
        ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 101}, "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}, "frequency_penalty"),
        ("completion", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completion", {"prompt": [1, True]}, "prompt"),
    ],
)
def test_parse_request_names_the_bad_field(kind, body, param):
    with pytest.raises(APIError) as e:
        parse_request(kind, body, LIMITS)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


# ---- auth and rate limit ------------------------------------------------------------------------
def test_wrong_or_missing_key(multi):
    with pytest.raises(openai.AuthenticationError) as e:
        multi.client("sk-wrong").chat.completions.create(model=MODEL, messages=hello(), max_tokens=2)
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        multi.client("sk-wrong").models.list()
    r = httpx.post(multi.url + "/v1/chat/completions", json={"messages": hello(), "max_tokens": 2})
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert "Bearer" in err["message"]
    ok = multi.client("sk-bob").chat.completions.create(model=MODEL, messages=hello(), max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_rate_limit_per_user(servers):
    url = servers["limited"].url + "/v1/chat/completions"
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    # requests count before their body is read: two bad bodies use alice's two tokens
    assert [httpx.post(url, content=b"{}", headers=alice).status_code for _ in range(2)] == [400, 400]
    r = httpx.post(url, content=b"{}", headers=alice)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.post(url, content=b"{}", headers=bob).status_code == 400  # bob has his own bucket
    with pytest.raises(openai.RateLimitError):
        servers["limited"].client("sk-alice").chat.completions.create(model=MODEL, messages=hello(), max_tokens=1)
    # guessing keys is limited too (per client address)
    codes = [
        httpx.post(url, content=b"{}", headers={"Authorization": f"Bearer guess-{i}"}).status_code for i in range(3)
    ]
    assert codes == [401, 401, 429]


# ---- bad inputs ---------------------------------------------------------------------------------
LONG = "hello " * 9000  # > 8192 tokens: over the context


def chat_body(**kw):
    return json.dumps({"model": MODEL, "messages": hello(), "max_tokens": 2, **kw})


# UTF-16 that is also valid UTF-8, with a lone surrogate in it: json.loads of the bytes would take it
UTF16_SURROGATE = '{"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800\x80"]}'.encode(
    "utf-16-le", "surrogatepass"
)
BAD = [
    # (route, raw body, expected status, text expected in the message)
    ("chat", '{"model": "x", "messages": [', 400, "invalid JSON"),
    ("chat", "[1, 2]", 400, "JSON object"),
    ("chat", "", 400, "empty"),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    ("chat", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
    ("chat", '{"messages": [{"role": "user", "content": "bad \\ud800 surrogate"}]}', 400, "surrogate"),
    ("chat", '{"messages": [{"role": "user", "content": "x"}], "stop": ["\\udfff"]}', 400, "surrogate"),
    ("chat", b'{"messages": [{"role": "user", "content": "bad \xed\xa0\x80 encoded surrogate"}]}', 400, "UTF-8"),
    # UTF-16 that is also valid UTF-8, a lone surrogate in it: json.loads of the bytes would take it
    (
        "chat",
        '{"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800\x80"]}'.encode("utf-16-le", "surrogatepass"),
        400,
        "JSON",
    ),
    ("chat", "[" * 100_000 + "]" * 100_000, 400, "JSON"),
    ("chat", json.dumps({"model": MODEL}), 400, "messages"),
    ("chat", json.dumps({"messages": []}), 400, "empty"),
    ("chat", json.dumps({"messages": "hi"}), 400, "messages"),
    ("chat", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "wizard"),
    ("chat", json.dumps({"messages": [{"role": "tool", "content": "hi"}]}), 400, "role"),
    ("chat", json.dumps({"messages": [{"role": "user", "content": 5}]}), 400, "content"),
    ("chat", json.dumps({"messages": [{"role": "user"}]}), 400, "content"),
    ("chat", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "text"),
    ("chat", chat_body(temperature=-1), 400, "temperature"),
    ("chat", chat_body(temperature=2.5), 400, "temperature"),
    ("chat", chat_body(temperature="hot"), 400, "temperature"),
    ("chat", chat_body(top_p=0), 400, "top_p"),
    ("chat", chat_body(top_p=1.5), 400, "top_p"),
    ("chat", chat_body(max_tokens=0), 400, "max_tokens"),
    ("chat", chat_body(max_tokens=-3), 400, "max_tokens"),
    ("chat", chat_body(max_tokens="10"), 400, "max_tokens"),
    ("chat", chat_body(max_tokens=10**9), 400, "max_tokens"),
    ("chat", chat_body(max_completion_tokens=True), 400, "max_completion_tokens"),
    ("chat", chat_body(max_tokens=4000), 400, "KV blocks"),  # fits the context, not the KV pool
    ("chat", chat_body(n=0), 400, "'n'"),
    ("chat", chat_body(n=1000), 400, "'n'"),
    ("chat", chat_body(n=1.5), 400, "'n'"),
    ("chat", chat_body(seed="abc"), 400, "seed"),
    ("chat", chat_body(stop=5), 400, "stop"),
    ("chat", chat_body(stop=[""]), 400, "stop"),
    ("chat", chat_body(stream="yes"), 400, "stream"),
    ("chat", chat_body(stream_options={"include_usage": True}), 400, "stream"),
    ("chat", chat_body(logprobs="yes"), 400, "logprobs"),
    ("chat", chat_body(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400, "tools[0]"),
    ("chat", chat_body(presence_penalty=3.0), 400, "presence_penalty"),
    ("chat", chat_body(model=7), 400, "model"),
    ("chat", json.dumps({"messages": [{"role": "user", "content": LONG}]}), 400, "context"),
    ("completions", json.dumps({"model": MODEL}), 400, "prompt"),
    ("completions", json.dumps({"prompt": ""}), 400, "empty"),
    ("completions", json.dumps({"prompt": []}), 400, "empty"),
    ("completions", json.dumps({"prompt": [1, "a"]}), 400, "token ids"),
    ("completions", json.dumps({"prompt": [1, -1]}), 400, "token ids"),
    ("completions", json.dumps({"prompt": [1, 10**12]}), 400, "token ids"),
    ("completions", json.dumps({"prompt": ["one"] * 65}), 400, "at most 64"),
    ("completions", json.dumps({"prompt": 12}), 400, "prompt"),
    ("completions", json.dumps({"prompt": "x", "echo": "yes"}), 400, "echo"),
    ("completions", json.dumps({"prompt": LONG}), 400, "context"),
    ("completions", '{"prompt": "' + "a" * 1_100_000 + '"}', 413, "bytes"),
]


@pytest.mark.parametrize("route,body,status,needle", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_clear_4xx(local, route, body, status, needle):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(local.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and needle.lower() in err["message"].lower(), err


def test_unknown_route_and_method(local):
    r = httpx.post(local.url + "/v1/embeddings", json={})
    assert r.status_code == 404 and "unknown route" in r.json()["error"]["message"]
    r = httpx.get(local.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_openai_client_sees_bad_request(local):
    with pytest.raises(openai.BadRequestError) as e:
        local.client().chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert "wizard" in str(e.value)


def test_still_healthy_after_bad_inputs(local, engine):
    assert httpx.get(local.url + "/health").status_code == 200
    r = local.client().chat.completions.create(model=MODEL, messages=hello(), max_tokens=3, temperature=0)
    assert r.choices[0].message.content
    wait_idle(engine)


# ---- engine failure mid-request -----------------------------------------------------------------
def test_engine_failure_is_reported_not_hung(local, engine):
    runner = engine.engine.runner
    real = runner.launch

    def broken(*a, **kw):
        raise RuntimeError("injected forward failure")

    runner.launch = broken
    try:
        r = httpx.post(local.url + "/v1/chat/completions", content=chat_body(), timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "injected" not in r.text  # no internals leak to the client
        with pytest.raises(openai.APIError):
            list(local.client().chat.completions.create(model=MODEL, messages=hello(), max_tokens=3, stream=True))
    finally:
        runner.launch = real
    wait_idle(engine)
    assert local.client().chat.completions.create(model=MODEL, messages=hello(), max_tokens=2).choices


# ---- disconnects free blocks --------------------------------------------------------------------
def test_disconnected_stream_frees_blocks(local, engine):
    wait_idle(engine)
    generated = engine.stats()["num_generated_tokens"]
    body = {
        "model": MODEL,
        "messages": hello("Write a long story."),
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", local.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        got = 0
        lines = resp.iter_lines()  # held: an abandoned line generator is closed, and the connection with it
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                got += 1
                if got >= 4:
                    break
        deadline = time.monotonic() + 2  # stats() is a snapshot published every 0.2 s at most
        while used_blocks(engine) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert used_blocks(engine) > 0 and engine.engine.requests  # it is running
    # the connection is closed: the request is aborted and its blocks are freed within a step or two
    wait_idle(engine, timeout=5)
    assert engine.stats()["num_generated_tokens"] - generated < 450


def test_a_stream_ends_with_503_when_the_engine_stops_without_a_word(serve):
    """An engine that stops and delivers nothing more (its thread gone) must not leave a stream
    waiting forever: the watcher sees it stop and the stream ends with a 503 error event."""
    eng = AsyncLLM("dummy:tiny", device="cpu", dtype="float32")
    eng._deliver_many = lambda items: None  # nothing the engine makes reaches a stream

    def stop_once_running():  # once the request runs, the engine reports itself stopped
        deadline = time.monotonic() + 20
        while not eng.engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        eng._stopped = True

    stop = threading.Thread(target=stop_once_running)
    try:
        url = serve(build_api(eng, None, model_name=MODEL)).url
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        stop.start()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "engine has stopped" in lines[-2], lines[-3:]
    finally:
        stop.join()
        eng._stopped = False
        eng.shutdown()


def test_disconnected_non_streaming_request_frees_blocks(local, engine):
    wait_idle(engine)
    generated = engine.stats()["num_generated_tokens"]
    body = {"model": MODEL, "messages": hello("Write a long story."), "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(local.url + "/v1/chat/completions", json=body, timeout=1.5)
    wait_idle(engine, timeout=5)
    assert engine.stats()["num_generated_tokens"] - generated < 450


def test_abort_storm_leaves_nothing_behind(local, engine):
    """Mixed concurrent requests (n=1..3, streamed or not), a quarter closed mid-stream and a quarter
    timed out: the others get exact token counts and afterwards no request or block is left."""
    import asyncio

    async def one(client, i):
        body = {
            "model": MODEL,
            "messages": hello(f"story {i}"),
            "max_tokens": 6,
            "n": 1 + i % 3,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": i,
        }
        if i % 4 == 0:
            async with client.stream("POST", local.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        return "closed"
            return "finished"
        if i % 4 == 2:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(local.url + "/v1/chat/completions", json={**body, "max_tokens": 300}, timeout=0.5)
            return "timed out"
        r = await client.post(local.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200
        return r.json()["usage"]["completion_tokens"] == 6 * body["n"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[one(client, i) for i in range(8)])

    results = asyncio.run(main())
    assert [r for i, r in enumerate(results) if i % 2] == [True] * 4, results
    wait_idle(engine, timeout=10)
    engine.engine.check_invariants()


# ---- isolation between users --------------------------------------------------------------------
def private_prompt():
    secret = uuid.uuid4().hex
    return [
        {"role": "system", "content": f"Private notebook {secret} of one user. Never share it."},
        {
            "role": "user",
            "content": f"My account number is {secret}; my doctor said my test came back. "
            "Summarise my situation in one short sentence.",
        },
    ]


def test_user_repeat_reports_cached_tokens(multi):
    alice = multi.client("sk-alice")
    messages = private_prompt()
    first = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    again = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_users_are_isolated_in_the_prefix_cache(multi):
    alice, carol = multi.client("sk-alice"), multi.client("sk-carol")
    messages = private_prompt()
    for _ in range(2):
        a = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens >= 32  # alice's blocks are in the cache
    # carol sends alice's exact private prompt (and claims to be alice in the body's `user` field)
    c = carol.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, user="alice")
    assert c.usage.prompt_tokens == a.usage.prompt_tokens
    assert c.usage.prompt_tokens_details.cached_tokens == 0


def test_public_persona_prefix_is_shared_across_users(multi, engine):
    personas = getattr(engine.engine, "personas", None)
    if not personas:
        pytest.skip("the engine registered no public personas")
    from chatengine.personas import load_personas

    persona = next(iter(load_personas().values()))
    bob, carol = multi.client("sk-bob"), multi.client("sk-carol")
    ask = lambda client, q: client.chat.completions.create(  # noqa: E731
        model=MODEL,
        max_tokens=1,
        temperature=0,
        messages=[{"role": "system", "content": persona.system_prompt}, {"role": "user", "content": q}],
    )
    ask(bob, f"bob asks {uuid.uuid4().hex}")
    c = ask(carol, f"carol asks {uuid.uuid4().hex}")
    public = len(personas[persona.name]) // 16 * 16
    assert c.usage.prompt_tokens_details.cached_tokens >= min(public, c.usage.prompt_tokens - 1) // 16 * 16
    assert c.usage.prompt_tokens_details.cached_tokens < c.usage.prompt_tokens


def test_text_past_the_context_is_refused_before_tokenizing(engine, local, monkeypatch):
    """~900 KB of prompt cannot fit 8192 tokens: 400 context_length_exceeded without running the
    tokenizer (before, it spent seconds tokenizing a prompt it was going to refuse anyway)."""

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(engine, "apply_chat_template", no_tokenizing)
    monkeypatch.setattr(engine, "encode", no_tokenizing)
    text = "word " * 180_000
    for route, body in (
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
        ("completions", {"model": MODEL, "prompt": text}),
    ):
        r = httpx.post(f"{local.url}/v1/{route}", json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert "900,000" in err["message"] or "900000" in err["message"]
    with pytest.raises(APIError) as e:
        parse_request("completion", {"prompt": "x" * 101}, Limits(4, 100, 128, 96, max_prompt_chars=100))
    assert e.value.param == "prompt"
    assert parse_request("completion", {"prompt": [1] * 50}, Limits(4, 100, 128, 96, max_prompt_chars=10)).prompt


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_plain_chunks_are_the_bytes_of_their_json(kind):
    """A chunk of new text alone is filled into the stream's template: the same bytes as json.dumps
    of its dict (escapes, non-ASCII, an empty chat delta, each finish reason)."""
    from chatengine.app.api.stream import Chunks, Job, _event
    from chatengine.sampling_params import SamplingParams

    job = Job(kind, 'cmpl-"q"é', [1, 2], SamplingParams(max_tokens=4), None, "m\\odel\u2028")
    chunks = Chunks([job], continuous_usage=False)
    for content in ["", "hi", 'é"\\\n\t\x01\x7f😀\u2028', "</script>"]:
        for reason in [None, "stop", "length"]:
            if kind == "chat":
                choice = {"index": 3, "delta": {"content": content} if content else {}}
            else:
                choice = {"index": 3, "text": content}
            choice |= {"logprobs": None, "finish_reason": reason}
            expected = _event(
                {"id": job.request_id, "object": chunks.object, "created": chunks.created, "model": job.model_name}
                | {"choices": [choice]}
            )
            assert chunks.chunk(3, content, reason) == expected
