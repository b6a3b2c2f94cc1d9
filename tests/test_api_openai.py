"""Issue #18 through real clients: the `openai` client (and httpx for raw SSE and CORS) and
langchain-openai's ChatOpenAI against one uvicorn server on loopback. Covers the fixed bugs
(completions default to 16 tokens, continuous usage as vLLM's, int64 seeds, out-of-vocabulary
stop_token_ids, max_tokens past the context), logprobs (chat and completions, echo, streamed),
penalties, logit_bias, min_tokens, structured outputs, several prompts per completions request,
and CORS.

Tests marked `needs_engine` exercise the engine half of #18 (logprobs, prompt logprobs, penalties,
logit_bias, min_tokens, structured outputs; on main since c2f96df / 4b2d7e2): they fail, never skip,
on an engine without it (`-m "not needs_engine"` runs the rest).
"""

import json
import math
import re

import httpx
import pytest

openai = pytest.importorskip("openai")

from chatengine import AsyncLLM  # noqa: E402
from chatengine.app.api.protocol import APIError, Limits, parse_request, sampling_params  # noqa: E402
from chatengine.app.api.routes import build_api  # noqa: E402

MODEL = "smollm2-135m-instruct"
ORIGIN = "https://chat.example.org"
USERS = {"dora": {"api_key": "sk-dora"}}

needs_engine = pytest.mark.needs_engine  # the engine half of #18 (see the module's docstring)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def urls(engine, serve):
    return {
        "local": serve(build_api(engine, None, model_name=MODEL, cors_origins=[ORIGIN])).url,
        "limited": serve(build_api(engine, USERS, model_name=MODEL, rate_limit_per_minute=4)).url,
    }


@pytest.fixture(scope="module")
def url(urls):
    return urls["local"]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=120)


def ask(text):
    return [{"role": "user", "content": text}]


def sse(url, path, body) -> list:
    """The data of each server-sent event (the final "[DONE]" checked and dropped)."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: ") :] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body if isinstance(e.value.body, dict) and "message" in e.value.body else e.value.body["error"]


# ---- the bugs -----------------------------------------------------------------------------------
def test_completions_default_to_16_tokens(client):
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_max_tokens_defaults_and_the_context_unit():
    limits = Limits(max_n=4, max_tokens=100, max_model_len=128, kv_capacity_tokens=1000)
    chat = parse_request("chat", {"messages": ask("x")}, limits)
    assert sampling_params(chat.sampling, 40, limits).max_tokens == 88  # chat: fills the context
    comp = parse_request("completion", {"prompt": "x"}, limits)
    assert sampling_params(comp.sampling, 40, limits).max_tokens == 16
    assert sampling_params(comp.sampling, 120, limits).max_tokens == 8  # what room is left
    explicit = parse_request("completion", {"prompt": "x", "max_tokens": 50}, limits)
    with pytest.raises(APIError) as e:
        sampling_params(explicit.sampling, 100, limits)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert "128" in e.value.message and "100" in e.value.message and "50" in e.value.message


def test_explicit_max_tokens_past_the_context_is_400(client, engine):
    for call in (
        lambda: client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=engine.max_model_len),
        lambda: client.completions.create(model=MODEL, prompt="Hi there", max_tokens=engine.max_model_len),
    ):
        err = bad_request(call)
        assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
        assert str(engine.max_model_len) in err["message"], err


def test_seed_takes_any_int64(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL, prompt="My favourite word is", max_tokens=6, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(-1) == sample(-1)
    assert sample(-1) == sample(2**63 - 1)  # -1 is 2**63 - 1 modulo 2**63, the engine's range
    assert sample(-(2**63)) == sample(0)
    err = bad_request(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, seed=2**63))
    assert err["param"] == "seed"


def test_out_of_vocabulary_stop_token_ids_are_400(client, engine):
    err = bad_request(
        lambda: client.chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=2, extra_body={"stop_token_ids": [2, engine.vocab_size]}
        )
    )
    assert err["param"] == "stop_token_ids" and str(engine.vocab_size) in err["message"]


def test_continuous_usage_on_every_chunk_including_the_role_chunk(url):
    body = {"model": MODEL, "messages": ask("Count to five."), "max_tokens": 5, "temperature": 0, "stream": True}
    on = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse(url, "/v1/chat/completions", {**body, "stream_options": on})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    first = chunks[0]["usage"]
    assert first["completion_tokens"] == 0 and first["total_tokens"] == first["prompt_tokens"] > 0
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    # without include_usage, continuous_usage_stats adds nothing (vLLM): no usage anywhere
    for opts in ({"continuous_usage_stats": True}, {"include_usage": False, "continuous_usage_stats": True}):
        for path, b in (
            ("/v1/chat/completions", body),
            ("/v1/completions", {"model": MODEL, "prompt": "1, 2,", "max_tokens": 4, "stream": True}),
        ):
            chunks = sse(url, path, {**b, "stream_options": opts})
            assert chunks and not any("usage" in c and c["usage"] for c in chunks), chunks
    # completions with both: every chunk, then the total
    chunks = sse(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": "1, 2,", "max_tokens": 4, "ignore_eos": True, "stream": True, "stream_options": on},
    )
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 4


def test_plain_requests_report_no_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


# ---- logprobs -----------------------------------------------------------------------------------
def check_chat_entry(entry, top: int, greedy: bool):
    assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert len(entry.top_logprobs) == top
    values = [t.logprob for t in entry.top_logprobs]
    assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-4
    for t in entry.top_logprobs:
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
    if top and greedy:  # the sampled token is the best one, with the same logprob
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    elif top:
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-5


@needs_engine
def test_chat_logprobs(client):
    kw = dict(model=MODEL, messages=ask("Name a colour."), max_tokens=6, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        check_chat_entry(entry, 3, greedy=True)
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    # top_logprobs 0 (or absent): the sampled tokens alone; sampled at temperature 1
    r = client.chat.completions.create(**kw, temperature=1.0, seed=5, logprobs=True)
    assert [len(e.top_logprobs) for e in r.choices[0].logprobs.content] == [0] * 6
    r = client.chat.completions.create(**kw, temperature=1.0, seed=5, logprobs=True, top_logprobs=20, n=2)
    for choice in r.choices:
        for entry in choice.logprobs.content:
            check_chat_entry(entry, 20, greedy=False)
    err = bad_request(lambda: client.chat.completions.create(**kw, top_logprobs=2))  # without logprobs: true
    assert err["param"] == "top_logprobs"
    err = bad_request(lambda: client.chat.completions.create(**kw, logprobs=True, top_logprobs=21))
    assert err["param"] == "top_logprobs"


@needs_engine
def test_chat_logprobs_streamed_match_the_whole_response(client):
    kw = dict(model=MODEL, messages=ask("Say something."), max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert chunks[0].choices[0].logprobs is None  # the role chunk adds no token


@needs_engine
def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(tops) <= 4 and value <= 0
        assert max(tops.values()) == pytest.approx(value, abs=1e-5) and tops[token] == pytest.approx(value)
    # logprobs 0: each token's own logprob, and a top_logprobs entry holding just the sampled token (vLLM)
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0.8, seed=1, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(v is not None and v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    err = bad_request(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=21))
    assert err["param"] == "logprobs"


@needs_engine
def test_echo_with_prompt_logprobs_and_max_tokens_0(client, engine):
    prompt = "The capital of France is"
    n_prompt = len(engine.encode(prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(prompt)
    # lm-eval's loglikelihood: echo, max_tokens 0, token ids: the prompt's logprobs, nothing generated.
    # Scoring the greedy continuation as a prompt gives the logprobs it was generated with.
    ids = engine.encode(prompt)
    gen = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=0)
    gen_lp = gen.choices[0].logprobs
    pieces = [engine.encode(token) for token in gen_lp.tokens]  # ASCII tokens: each reads back as itself
    assert all(len(piece) == 1 for piece in pieces), pieces
    gen_ids = [piece[0] for piece in pieces]
    score = client.completions.create(model=MODEL, prompt=ids + gen_ids, max_tokens=0, echo=True, logprobs=0)
    s = score.choices[0]
    assert s.finish_reason == "length" and score.usage.completion_tokens == 0
    assert s.text == prompt + gen.choices[0].text
    assert len(s.logprobs.tokens) == len(ids) + len(gen_ids) == score.usage.prompt_tokens
    assert s.logprobs.token_logprobs[len(ids) :] == pytest.approx(gen_lp.token_logprobs, abs=1e-3)
    # echo without logprobs; max_tokens 0 without echo is refused
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert r.choices[0].text == prompt and r.choices[0].logprobs is None
    assert bad_request(lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=0))["param"] == (
        "max_tokens"
    )


@needs_engine
def test_echo_logprobs_streamed(url, client):
    body = dict(model=MODEL, prompt="Roses are red,", max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**body).choices[0]
    chunks = sse(url, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.text
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and chunks[0]["choices"][0]["text"].startswith("Roses are red,")
    # max_tokens 0, streamed: one chunk with the prompt
    chunks = sse(url, "/v1/completions", {**body, "max_tokens": 0, "stream": True})
    assert [c["choices"][0]["text"] for c in chunks] == ["Roses are red,"]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"


# ---- penalties, logit_bias, min_tokens ----------------------------------------------------------
@needs_engine
def test_penalties_are_accepted_and_change_the_output(client):
    kw = dict(model=MODEL, prompt="one one one one one one one one", max_tokens=8, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    # what Open WebUI and LibreChat send
    for extra in (
        {"presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"presence_penalty": -2, "frequency_penalty": 2},
    ):
        assert client.completions.create(**kw, **extra).choices[0].finish_reason in ("stop", "length")
    repeated = client.completions.create(**kw, extra_body={"repetition_penalty": 2.0}).choices[0].text
    frequent = client.completions.create(**kw, frequency_penalty=2.0).choices[0].text
    assert plain.count("one") > repeated.count("one") or plain != repeated
    assert plain != frequent or plain.count("one") == 0
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}):
        assert bad_request(lambda: client.completions.create(**kw, **bad))["param"] == next(iter(bad))
    err = bad_request(lambda: client.completions.create(**kw, extra_body={"repetition_penalty": 0}))
    assert err["param"] == "repetition_penalty"


@needs_engine
def test_logit_bias(client, engine):
    kw = dict(model=MODEL, prompt="The colour of grass is", max_tokens=4, temperature=0, logprobs=0)
    plain = client.completions.create(**kw)
    first = engine.encode(plain.choices[0].logprobs.tokens[0])
    banned = client.completions.create(**kw, logit_bias={str(first[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    forced_id = engine.encode(" banana")[0]
    forced = client.completions.create(**kw, logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == engine.get_tokenizer().decode([forced_id] * 4)
    for bad in ({"x": 1}, {"1": 101}, {str(engine.vocab_size): 1}):
        assert bad_request(lambda: client.completions.create(**kw, logit_bias=bad))["param"] == "logit_bias"


@needs_engine
def test_min_tokens(client):
    kw = dict(model=MODEL, messages=ask("Answer with one word: is the sky blue?"), max_tokens=30, temperature=0)
    short = client.chat.completions.create(**kw)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    long = client.chat.completions.create(**kw, extra_body={"min_tokens": 12})
    assert long.usage.completion_tokens >= 12
    err = bad_request(lambda: client.chat.completions.create(**kw, extra_body={"min_tokens": 31}))
    assert err["param"] == "min_tokens"


# ---- structured outputs -------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


PERSON_QUESTION = "Invent a person: give a name and an age."


def matches_person(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and isinstance(value["age"], int)
    )


@needs_engine
def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=ask(PERSON_QUESTION), max_tokens=60, temperature=0, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert matches_person(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("Give a JSON object with a key 'a'."),
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object so far
        assert r.choices[0].message.content.lstrip().startswith("{")
    # {"type": "text"} is no constraint; completions take response_format too (as vLLM)
    r = client.completions.create(
        model=MODEL, prompt="A person:", max_tokens=60, temperature=0, extra_body={"response_format": fmt}
    )
    assert matches_person(json.loads(r.choices[0].text))


@needs_engine
def test_choice_regex_and_grammar(client, url):
    colours = ["red", "green", "blue"]
    kw = dict(model=MODEL, messages=ask("Pick a colour."), max_tokens=10, temperature=1.0, seed=3)
    for extra in ({"structured_outputs": {"choice": colours}}, {"guided_choice": colours}):
        r = client.chat.completions.create(**kw, extra_body=extra)
        assert r.choices[0].message.content in colours
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    grammar = 'root ::= "yes" | "no"'
    for extra in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        r = client.chat.completions.create(**kw, extra_body=extra)
        assert r.choices[0].message.content in ("yes", "no")
    # streamed with n=2: each choice's text is one of the choices
    body = {**kw, "n": 2, "stream": True, "guided_choice": colours}
    chunks = sse(url, "/v1/chat/completions", body)
    texts = ["", ""]
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert all(t in colours for t in texts)


@needs_engine
def test_bad_structured_outputs_are_400(client):
    kw = dict(model=MODEL, messages=ask("x"), max_tokens=5)
    err = bad_request(lambda: client.chat.completions.create(**kw, extra_body={"guided_regex": "(unclosed"}))
    assert err["param"] == "guided_regex" and err["message"]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    err = bad_request(lambda: client.chat.completions.create(**kw, response_format=bad_schema))
    assert err["param"] == "response_format" and err["message"]


def test_structured_output_request_shapes_are_checked(client):
    kw = dict(model=MODEL, messages=ask("x"), max_tokens=5)
    for extra, param in (
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ):
        assert bad_request(lambda: client.chat.completions.create(**kw, extra_body=extra))["param"] == param, extra


# ---- several prompts ----------------------------------------------------------------------------
def test_several_prompts(client, engine, url):
    prompts = ["The capital of France is", "1, 2, 3,", "Hello"]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(**kw, prompt=p).choices[0].text for p in prompts]
    r = client.completions.create(**kw, prompt=prompts, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]  # prompt_index * n + i
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == sum(len(engine.encode(p)) for p in prompts)
    # token-id prompts, streamed, with usage summed
    ids = [engine.encode(p) for p in prompts]
    chunks = sse(
        url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    texts = [""] * 3
    finishes = []
    for c in chunks[:-1]:
        [choice] = c["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes.append(choice["index"])
    assert texts == alone and sorted(finishes) == [0, 1, 2]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_several_prompts_are_capped_before_tokenizing(url, engine, monkeypatch):
    """Each prompt of a batch is held to the one-prompt cap, and the batch to 64 prompts, before the
    tokenizer sees any of them."""

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized a request that is refused")

    monkeypatch.setattr(engine, "encode", no_tokenizing)
    too_long = "word " * (engine.max_prompt_chars // 5 + 1)
    for prompts, needle in ((["fine", too_long], "prompt[1]"), (["a"] * 65, "at most 64")):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_several_prompts_count_against_the_rate_limit(urls):
    url = urls["limited"] + "/v1/completions"
    headers = {"Authorization": "Bearer sk-dora"}
    body = {"model": MODEL, "max_tokens": 1}
    r = httpx.post(url, json={**body, "prompt": ["a"] * 5}, headers=headers, timeout=60)
    assert r.status_code == 429 and "5 prompts" in r.json()["error"]["message"]  # can never fit 4 a minute
    assert httpx.post(url, json={**body, "prompt": ["a", "b"]}, headers=headers, timeout=60).status_code == 200
    # 1 + 2 (the first two requests) + this one's 1 of its 2: the second prompt finds the bucket empty
    r = httpx.post(url, json={**body, "prompt": ["a", "b"]}, headers=headers, timeout=60)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


# ---- CORS ---------------------------------------------------------------------------------------
def test_cors(url, urls):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.options(url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(url + "/elsewhere", headers={"Origin": ORIGIN})  # not the API: no CORS
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(urls["limited"] + "/health", headers={"Origin": ORIGIN})  # off by default
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_client_that_sends_no_settings_gets_the_models_defaults_and_the_servers_cap(engine, serve):
    """Open WebUI sends neither temperature nor max_tokens: the embedded model's own settings apply
    (seeded, the reply equals one asked with them explicitly) and the server's cap ends the reply."""
    url = serve(build_api(engine, None, model_name=MODEL, default_max_tokens=6)).url
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=120)
    bare = client.chat.completions.create(model=MODEL, messages=ask("Name a colour."), seed=5)
    assert bare.usage.completion_tokens <= 6
    explicit = client.chat.completions.create(
        model=MODEL, messages=ask("Name a colour."), seed=5, temperature=0.2, top_p=0.9, max_tokens=6
    )
    assert bare.choices[0].message.content == explicit.choices[0].message.content
    assert bare.choices[0].finish_reason == explicit.choices[0].finish_reason


def test_default_max_tokens_flag(tmp_path):
    from chatengine.app.server import DEFAULT_MAX_TOKENS, build_parser, create_app

    assert build_parser().parse_args([]).default_max_tokens == DEFAULT_MAX_TOKENS == 2048
    assert build_parser().parse_args(["--default-max-tokens", "0"]).default_max_tokens == 0
    with pytest.raises(ValueError, match="--default-max-tokens"):
        create_app(data_dir=tmp_path, default_max_tokens=-3)


def test_cors_flag():
    from chatengine.app.api.cors import check_origins
    from chatengine.app.server import build_parser

    args = build_parser().parse_args(["--cors-origins", "https://a.example", "http://localhost:3000"])
    assert args.cors_origins == ["https://a.example", "http://localhost:3000"]
    assert build_parser().parse_args([]).cors_origins is None
    assert check_origins(["*"]) == ["*"]
    for bad in (["a.example"], ["https://a.example/"], "https://a.example"):
        with pytest.raises(ValueError):
            check_origins(bad)


# ---- LangChain ----------------------------------------------------------------------------------
def chat_model(url, max_tokens=8):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=url + "/v1",
        api_key="sk-none",
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=120,
    )


def test_langchain_invoke_and_stream(url):
    model = chat_model(url)
    answer = model.invoke("Say hello.")
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.content for chunk in model.stream("Say hello."))
    assert streamed == answer.content


@needs_engine
def test_langchain_with_structured_output(url):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    structured = chat_model(url, max_tokens=60).with_structured_output(Person)  # ChatOpenAI's default: json_schema
    person = structured.invoke(PERSON_QUESTION)
    assert isinstance(person, Person) and person.name
