"""The engine on the default model: equal to Hugging Face greedy, invariant to chunking, preemption
and batch composition; sampling knobs; bad input; streaming and abort."""

import asyncio
import time

import pytest
import torch

from chatengine import LLM, AsyncLLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain what a KV cache is in one sentence."}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    out = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def hf_reference(llm, prompt_ids):
    """Hugging Face transformers generate, one prompt at a time, same weights, fp32 CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.engine.hf_dir, dtype=torch.float32).eval()
    eos = sorted(llm.engine.eos_token_ids)
    refs = []
    for ids in prompt_ids:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
        refs.append(out[0, len(ids) :].tolist())
    return refs


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_hf_batched(either, prompt_ids, hf_reference):
    assert token_ids(either.generate(prompt_ids, GREEDY)) == hf_reference


def test_greedy_equals_hf_one_at_a_time(llm, prompt_ids, hf_reference):
    assert [token_ids(llm.generate([ids], GREEDY))[0] for ids in prompt_ids] == hf_reference


def test_chat_uses_the_template(llm, prompt_ids, hf_reference):
    outs = llm.chat(CHATS[:2], GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompt_ids[:2]
    assert token_ids(outs) == hf_reference[:2]
    assert "Paris" in outs[0].outputs[0].text


def test_batch_composition_does_not_change_greedy(either, prompt_ids, hf_reference):
    order = [3, 0, 4, 1, 2]
    outs = either.generate([prompt_ids[i] for i in order] + [prompt_ids[0]], GREEDY)
    assert token_ids(outs) == [hf_reference[i] for i in order] + [hf_reference[0]]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption_do_not_change_greedy(prompt_ids, hf_reference, async_scheduling):
    # 16-token budget: every prompt is prefilled in chunks, mixed with other sequences' decodes;
    # 14 blocks of 16: the five sequences cannot all fit, so the newest are preempted and recomputed
    small = LLM(
        max_num_batched_tokens=16,
        num_kv_blocks=14,
        enable_prefix_caching=False,
        debug_checks=True,
        async_scheduling=async_scheduling,
        quantization="none",
    )
    outs = small.generate(prompt_ids, GREEDY)
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert token_ids(outs) == hf_reference
    assert stats["kv_blocks_used"] == 0


def test_greedy_with_prefix_cache_hits_equals_without(either, prompt_ids, hf_reference):
    first = either.generate(prompt_ids[:2], GREEDY)
    again = either.generate(prompt_ids[:2], GREEDY)
    assert token_ids(first) == token_ids(again) == hf_reference[:2]
    assert all(o.num_cached_tokens > 0 for o in again)


def test_seeds_reproduce_and_differ(either):
    p = "Tell me a story about a cat."
    a = either.generate(p, SamplingParams(temperature=1.0, max_tokens=20, seed=1, ignore_eos=True))[0]
    b = either.generate(p, SamplingParams(temperature=1.0, max_tokens=20, seed=1, ignore_eos=True))[0]
    c = either.generate(p, SamplingParams(temperature=1.0, max_tokens=20, seed=2, ignore_eos=True))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids != c.outputs[0].token_ids
    # the same seeded request gives the same tokens beside other traffic
    mixed = either.generate(
        ["Hi", p, "Bye"],
        [
            SamplingParams(max_tokens=5),
            SamplingParams(temperature=1.0, max_tokens=20, seed=1, ignore_eos=True),
            SamplingParams(max_tokens=7),
        ],
    )
    assert mixed[1].outputs[0].token_ids == a.outputs[0].token_ids


def test_n_samples_are_distinct_and_reproducible(either):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    out = either.generate("Name a colour.", sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    ids = [c.token_ids for c in out.outputs]
    assert len({tuple(i) for i in ids}) == 3
    assert [c.token_ids for c in either.generate("Name a colour.", sp)[0].outputs] == ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forked_samples_beyond_max_num_seqs_run(either, async_scheduling):
    """n > 1 samples fork after admission, so more sequences run than max_num_seqs (here 8 beside
    max_num_seqs=2): steps take max_num_seqs of them at a time, every sample runs to its end, and
    each sample's tokens are those of an engine with room for all of them."""
    prompts = ["Name a colour.", "Count to five."]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    small = LLM(
        max_num_seqs=2, max_num_batched_tokens=512, kv_cache_gib=0.25, quantization="none",
        async_scheduling=async_scheduling, register_personas=False,
    )  # fmt: skip
    try:
        got = [[c.token_ids for c in o.outputs] for o in small.generate(prompts, sp)]
    finally:
        small.shutdown()
    assert got == [[c.token_ids for c in o.outputs] for o in either.generate(prompts, sp)]
    assert all(len(ids) == 12 for sample in got for ids in sample)


def test_many_forked_samples_of_long_prompts_fit_every_step():
    """16 samples each of two 1500-token prompts beside max_num_seqs=2: a step of all 32 would
    overflow the runner's staging buffer (sized for max_num_seqs block tables of this width), which
    failed every request of the step."""
    llm = LLM("dummy:tiny", device="cpu", max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=512)
    try:
        prompts = [[(7 * i + j) % 200 + 1 for j in range(1500)] for i in range(2)]
        outs = llm.generate(prompts, SamplingParams(n=16, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [[(c.finish_reason, len(c.token_ids)) for c in o.outputs] for o in outs] == [[("length", 4)] * 16] * 2


def test_top_k_1_and_tiny_top_p_are_greedy(either, prompt_ids, hf_reference):
    for sp in (
        SamplingParams(temperature=0.8, top_k=1, max_tokens=24, seed=3),
        SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=24),
    ):
        assert token_ids(either.generate(prompt_ids[:2], sp)) == hf_reference[:2]


def test_max_tokens_ignore_eos_and_stops(either, prompt_ids, hf_reference):
    out = either.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert out.token_ids == hf_reference[0][:3] and out.finish_reason == "length"
    full = either.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] in either.engine.eos_token_ids
    assert full.text == "The capital of France is Paris."  # EOS is not in the text
    long = either.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(long.outputs[0].token_ids) == 30 and long.outputs[0].finish_reason == "length"
    stop = either.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=24, stop=["France"]))[0]
    assert stop.outputs[0].text == "The capital of " and stop.outputs[0].stop_reason == "France"
    tok = hf_reference[0][2]
    stop_id = either.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok]))[0]
    assert stop_id.outputs[0].token_ids == hf_reference[0][:3] and stop_id.outputs[0].stop_reason == tok


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ([], None, "empty"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(n=0), "n must"),
        ("hi", SamplingParams(n=1000), "n must"),
        ("hi", SamplingParams(temperature=-1), "temperature"),
        ("hi", SamplingParams(temperature=float("nan")), "temperature"),
        ("hi", SamplingParams(top_p=0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(top_k=-2), "top_k"),
        ("hi", SamplingParams(max_tokens=10**9), "max_tokens"),
        ([1, 2, 10**9], None, "token ids"),
        ("bad \ud800 surrogate", None, "Unicode"),
        (3.5, None, "prompt"),
    ],
)
def test_bad_input_is_a_clear_error_and_nothing_leaks(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt] if not isinstance(prompt, list) else [prompt], params)
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2))[0].finished


def test_over_long_prompt_and_half_bad_batch(llm):
    too_long = [1] * llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long])
    with pytest.raises(ValueError, match="max_tokens"):  # the good prompt is not run either
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=-1)])
    assert llm.stats()["num_generated_tokens"] >= 0 and not llm.engine.requests


def test_bad_chat_messages(llm):
    for messages, match in (
        ([], "non-empty"),
        ([{"role": "wizard", "content": "x"}], "unknown role"),
        ([{"role": "user"}], "role' and 'content'"),
        ([{"role": "user", "content": 5}], "string"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.chat(messages)


def test_unknown_model_path_and_malformed_gguf(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="unknown dummy shape"):
        LLM("dummy:nonsense")


def test_stats_keys(llm):
    stats = llm.stats()
    for key in (
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_blocks_cached",
        "cpu_blocks_used",
        "disk_blocks",
        "prefix_cache_hit_rate",
    ):
        assert key in stats
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] > 0


def test_detokenizer_streams_whole_characters(llm):
    from chatengine.engine.tokenizer import IncrementalDetokenizer

    tok = llm.get_tokenizer()
    text = "Olá, naïve café 🤖🎉 — 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len([d for d in deltas if d]) > 5


async def _stream(engine, prompt, params, request_id, user=None):
    texts = []
    async for out in engine.generate(prompt, params, request_id=request_id, user=user):
        texts.append(out.outputs[0].text)
        last = out
    return texts, last


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_streaming_concurrent_and_abort(async_scheduling):
    engine = AsyncLLM(max_num_batched_tokens=256, kv_cache_gib=0.1, async_scheduling=async_scheduling)

    async def main():
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        runs = [_stream(engine, f"Count to {i}:", greedy, f"r{i}") for i in range(6)]

        async def aborted():
            seen = 0
            async for out in engine.generate(
                "Tell me a long story.", SamplingParams(max_tokens=500, ignore_eos=True), request_id="victim"
            ):
                seen += 1
                if seen == 3:
                    await engine.abort("victim")
                if out.finished:
                    return out

        async def closed_early():  # a client that walks away: closing the stream aborts
            gen = engine.generate(
                "Another long story.", SamplingParams(max_tokens=500, ignore_eos=True), request_id="walker"
            )
            async for _ in gen:
                break
            await gen.aclose()

        results = await asyncio.gather(*runs, aborted(), closed_early())
        for texts, last in results[:6]:
            assert last.finished and len(last.outputs[0].token_ids) == 16
            assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
            assert len(texts) >= 8  # streamed
        victim = results[6]
        assert victim.outputs[0].finish_reason == "abort" and len(victim.outputs[0].token_ids) < 500
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in engine.generate("x", SamplingParams(max_tokens=0)):
                pass
        for _ in range(100):  # the walker's abort is processed by the loop
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
        assert not engine.engine.requests
        for _ in range(100):  # stats() is a snapshot the loop publishes
            if engine.stats()["kv_blocks_used"] == 0:
                break
            time.sleep(0.02)
        assert engine.stats()["kv_blocks_used"] == 0
        engine.engine.check_invariants()
    finally:
        engine.shutdown()


def test_outputs_are_built_only_for_streamed_requests(tiny):
    """LLM.generate keeps only final outputs, so its requests (stream=False) get none until they
    finish; a streamed request gets one snapshot per token. Both end the same."""
    engine = tiny.engine
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    streamed, quiet = engine.make_request([1, 2, 3, 4, 5], sp), engine.make_request([1, 2, 3, 4, 5], sp)
    quiet.stream = False
    engine.add(streamed)
    engine.add(quiet)
    seen = {streamed.request_id: [], quiet.request_id: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    outs = seen[streamed.request_id]
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]  # snapshots, not one live list
    (final,) = seen[quiet.request_id]
    assert final.finished and final.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert final.outputs[0].finish_reason == "length"


def test_stream_interval_sends_the_first_token_then_every_nth_step_and_the_end():
    """stream_interval=3: a streamed request's outputs after 1, 4, 7 tokens and at its end (8); the
    tokens are those of interval 1."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lengths = {}
    for interval in (1, 3):
        engine = LLM("dummy:tiny", device="cpu", stream_interval=interval, enable_prefix_caching=False).engine
        engine.add(engine.make_request([1, 2, 3, 4, 5], sp, request_id="r"))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        lengths[interval] = [len(o.outputs[0].token_ids) for o in outs]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths[f"ids{interval}"] = outs[-1].outputs[0].token_ids
        engine.close()
    assert lengths[1] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert lengths[3] == [1, 4, 7, 8]
    assert lengths["ids1"] == lengths["ids3"]
    for bad in (0, 65, True, 1.5):
        with pytest.raises(ValueError, match="stream_interval"):
            LLM("dummy:tiny", device="cpu", stream_interval=bad)


def test_a_relay_sets_the_chunks_of_streams_unless_stream_interval_does():
    """relay_interval (a replica's) maps the running sequences to the steps between outputs; the
    engine's figures say the interval in force; a configured stream_interval wins."""
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    for configured, expected in ((None, [1, 3, 5, 7]), (1, [1, 2, 3, 4, 5, 6, 7])):
        engine = LLM("dummy:tiny", device="cpu", stream_interval=configured, enable_prefix_caching=False).engine
        assert engine.stream_interval() == (configured or 1)  # no relay: a token a chunk
        seen = []
        engine.relay_interval = lambda n: seen.append(n) or 2
        engine.add(engine.make_request([1, 2, 3, 4, 5], sp, request_id="r"))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [len(o.outputs[0].token_ids) for o in outs] == expected
        assert engine.stats()["stream_interval"] == (configured or 2)
        assert (1 in seen) == (configured is None)  # asked with the one running sequence
        engine.close()


def test_a_preempted_stream_sends_what_it_held_back_at_once():
    """With long chunks (stream_interval 64), a stream preempted for blocks gets an output in the
    step that preempts it, holding every token it has: it does not wait for its return to show them."""
    from chatengine.engine.sequence import SequenceStatus

    engine = LLM(
        "dummy:tiny", device="cpu", stream_interval=64, num_kv_blocks=6, enable_prefix_caching=False,
        async_scheduling=False,
    ).engine  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(2):  # 20-token prompts: 2 blocks each now, 4 each at the end: 8 > 6
        engine.add(engine.make_request(list(range(1 + i, 21 + i)), sp, request_id=f"r{i}"))
    last: dict[str, int] = {}
    checked = 0
    while engine.has_unfinished_requests():
        before = engine.scheduler.num_preemptions
        outs = engine.step()
        for o in outs:
            last[o.request_id] = len(o.outputs[0].token_ids)
        if engine.scheduler.num_preemptions > before:
            for rid, req in engine.requests.items():
                seq = req.seqs[0]
                if seq.status == SequenceStatus.WAITING and seq.num_tokens > seq.num_prompt_tokens:
                    assert last[rid] == seq.num_tokens - seq.num_prompt_tokens  # nothing held back
                    checked += 1
    engine.close()
    assert checked >= 1


def test_a_request_finishes_when_all_its_samples_have(tiny):
    engine = tiny.engine
    sp = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    engine.add(engine.make_request([1, 2, 3, 4, 5, 6], sp, request_id="n3"))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert [c.finish_reason for c in outs[-1].outputs] == ["length"] * 3
    engine.add(engine.make_request([1, 2, 3], sp, request_id="early"))  # aborted before it forks
    out = engine.abort("early")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"]
    engine.add(engine.make_request([1, 2, 3], SamplingParams(n=2, max_tokens=50, ignore_eos=True), request_id="mid"))
    engine.step()
    engine.step()
    out = engine.abort("mid")  # aborted after it forked
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 2


def test_a_closed_caller_loop_aborts_only_its_own_requests():
    """Outputs go to each caller's event loop in one batch per step; when a loop has closed (its
    caller vanished without closing the stream), its requests are aborted and others stream on."""
    engine = AsyncLLM("dummy:tiny", num_kv_blocks=64, max_num_batched_tokens=64)
    try:
        closed = asyncio.new_event_loop()
        closed.close()
        for i in range(2):
            req = engine.engine.make_request(
                [1, 2, 3, i], SamplingParams(max_tokens=500, ignore_eos=True), request_id=f"gone{i}"
            )
            engine.post(("add", req, (closed, asyncio.Queue())))

        async def live():
            return [out async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))]

        outs = asyncio.run(live())
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        lengths = [len(o.outputs[0].token_ids) for o in outs]  # a caller behind takes the newest
        assert lengths == sorted(set(lengths)) and lengths[-1] == 8
        for _ in range(100):
            if not engine.engine.requests:
                break
            time.sleep(0.02)
        assert not engine.engine.requests
        assert engine.engine.num_generated_tokens < 100  # the vanished callers' requests stopped early
    finally:
        engine.shutdown()


# ---- async scheduling ---------------------------------------------------------------------------------
def test_async_scheduling_gives_the_sync_tokens(llm, llm_async, prompt_ids):
    """Seeded sampling (n > 1, top-p), stop strings, EOS and max_tokens: the same tokens, texts and
    finish reasons whether step N+1 is scheduled before or after step N's tokens are known."""
    params = [
        SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, seed=9, max_tokens=30, stop=[" the"]),
        GREEDY,
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    sync, overlapped = llm.generate(prompt_ids, params), llm_async.generate(prompt_ids, params)

    def view(outs):
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]

    assert view(overlapped) == view(sync)
    assert {c.finish_reason for o in sync for c in o.outputs} == {"stop", "length"}


def test_rows_that_read_their_tokens_keep_the_sync_tokens_beside_plain_ones(llm, llm_async, prompt_ids):
    """Penalties and min_tokens read every token on the host: under async scheduling such a row
    takes every other step while the plain rows keep overlapping, and every row's tokens are the
    ones the synchronous engine gives."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, presence_penalty=0.7, min_tokens=8),
    ]
    prompts = prompt_ids[: len(params)]
    sync, overlapped = llm.generate(prompts, params), llm_async.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in overlapped] == [[c.token_ids for c in o.outputs] for o in sync]
    assert len(sync[2].outputs[0].token_ids) >= 8


def test_abort_and_finish_with_a_step_in_flight(llm_async):
    engine = llm_async.engine
    engine.add(
        engine.make_request(
            "Tell me about the sea.", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id="a"
        )
    )
    engine.add(
        engine.make_request(
            "And the sky.", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), request_id="b"
        )
    )
    outs = []
    for _ in range(3):
        outs += engine.step()
    assert engine._in_flight is not None and engine.requests["a"].seqs[0].num_pending
    out = engine.abort("a")  # its pending tokens are not output
    assert out.finished and out.outputs[0].finish_reason == "abort"
    streamed = [o for o in outs if o.request_id == "a"][-1].outputs[0].token_ids
    assert out.outputs[0].token_ids == streamed and -1 not in streamed
    while engine.has_unfinished_requests():
        outs += engine.step()
    b = [o for o in outs if o.request_id == "b"]
    assert [len(o.outputs[0].token_ids) for o in b] == [1, 2, 3] and b[-1].finished
    engine.step()  # collects the last (wasted) step
    assert engine._in_flight is None
