"""Prefix caching on the default model: the cache never changes an answer; fork shares the prompt;
personas are shared across users while everything else stays private to its user."""

import pytest

from chatengine import LLM, SamplingParams
from chatengine.engine.kv.hashing import hash_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=12)
# the tests that read only which prompt blocks hit (users, personas, salts) decode one token: the
# hits are the prompt's full blocks, the same whatever follows them
ONE = SamplingParams(temperature=0, max_tokens=1)
PERSONA = (
    "You are a patient maths tutor. Explain every step in plain words, check the student's "
    "reasoning, and end with one short practice question they can try on their own."
)


def conversation(system, *turns):
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


@pytest.fixture(scope="module")
def no_cache():
    return LLM(enable_prefix_caching=False, max_num_batched_tokens=512, kv_cache_gib=0.1, quantization="none")


def test_cache_on_and_off_give_the_same_greedy_tokens(llm, no_cache):
    chats = [
        conversation(PERSONA, "What is 12 times 7?"),
        conversation(PERSONA, "What is 12 times 7?", "84.", "And 12 times 8?"),
        conversation(None, "Tell me about the moon in a long sentence please, with details."),
        conversation(
            None, "Tell me about the moon in a long sentence please, with details.", "It orbits.", "How far away is it?"
        ),
    ]
    ref = [o.outputs[0].token_ids for o in no_cache.chat(chats, GREEDY)]
    first = llm.chat(chats, GREEDY)
    again = llm.chat(chats, GREEDY)  # now every full block of each prompt hits
    assert [o.outputs[0].token_ids for o in first] == ref
    assert [o.outputs[0].token_ids for o in again] == ref
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert all(o.num_cached_tokens < len(o.prompt_token_ids) for o in again)
    assert no_cache.stats()["prefix_cache_hit_rate"] == 0


def test_a_follow_up_turn_hits_the_history(llm):
    tok = llm.get_tokenizer()
    chat = conversation(None, "Give me three tips for sleeping well tonight, please, in detail.")
    first = llm.chat(chat, GREEDY)[0]
    history = first.prompt_token_ids + first.outputs[0].token_ids
    follow = history + tok.encode(
        "\n<|im_start|>user\nAnd one more?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    out = llm.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens == (len(history) // 16) * 16  # every full block of the history


def test_first_sample_of_a_fork_equals_n1_greedy(llm):
    prompt = conversation(None, "Name three rivers in Europe.")
    single = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    before = llm.stats()["num_forks"]
    forked = llm.chat(prompt, SamplingParams(n=3, temperature=0, max_tokens=16))[0]
    assert llm.stats()["num_forks"] - before == 2
    assert [c.token_ids for c in forked.outputs] == [single.outputs[0].token_ids] * 3


def test_forked_samples_are_seeded_per_index(llm):
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    a = llm.generate("Once upon a time", sp)[0]
    b = llm.generate("Once upon a time", sp)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4


def test_a_persona_is_shared_across_users_but_conversations_are_not(llm):
    llm.register_persona("maths-tutor", PERSONA)
    alice = conversation(PERSONA, "Alice asks: what is a prime number? Please explain carefully.")
    llm.chat(alice, ONE, user="alice")
    persona_len = len(llm.engine.personas["maths-tutor"])
    public_blocks = persona_len // 16
    assert public_blocks >= 2

    bob_same_persona = conversation(PERSONA, "Bob wants to know how fractions work, step by step.")
    out = llm.chat(bob_same_persona, ONE, user="bob")[0]
    assert out.num_cached_tokens == public_blocks * 16  # the persona's blocks, no more

    bob_copies_alice = llm.chat(alice, ONE, user="bob")[0]  # bob sends alice's exact text
    assert bob_copies_alice.num_cached_tokens == public_blocks * 16  # never alice's own blocks
    alice_again = llm.chat(alice, ONE, user="alice")[0]
    assert alice_again.num_cached_tokens > public_blocks * 16  # alice hits her own history


def test_an_unregistered_persona_is_no_longer_shared_and_its_pages_leave_the_cache(llm):
    prompt = "You are a pirate captain who answers every question in a sea shanty. " * 3
    llm.register_persona("pirate", prompt)
    chat = conversation(prompt, "Where is the treasure buried on the island?")
    llm.chat(chat, ONE, user="alice")
    ids = llm.engine.personas["pirate"]
    public = hash_blocks(llm.engine.block_manager.root, ids, 16)
    assert len(public) >= 2 and all(h in llm.engine.block_manager.cached for h in public)
    llm.unregister_persona("pirate")
    llm.unregister_persona("pirate")  # twice, or an unknown name: nothing happens
    assert "pirate" not in llm.engine.personas
    assert not any(h in llm.engine.block_manager.cached for h in public)  # unpublished
    assert llm.chat(chat, ONE, user="bob")[0].num_cached_tokens == 0  # none of it, none of alice's
    # alice's history now hashes salted from its first block: computed once more, then hers alone
    llm.chat(chat, ONE, user="alice")
    assert llm.chat(chat, ONE, user="alice")[0].num_cached_tokens > 0


def test_unregistering_keeps_the_pages_that_a_registered_persona_shares(llm):
    prompt = "You are a lighthouse keeper who answers calmly and briefly, always. " * 3
    llm.register_persona("keeper", prompt)
    llm.register_persona("keeper-copy", prompt)  # an admin's copy of the same public text
    llm.chat(conversation(prompt, "Is a storm coming tonight?"), ONE, user="alice")
    llm.unregister_persona("keeper")
    out = llm.chat(conversation(prompt, "What do you do all day?"), ONE, user="bob")[0]
    assert out.num_cached_tokens == len(llm.engine.personas["keeper-copy"]) // 16 * 16
    llm.unregister_persona("keeper-copy")


def test_a_private_system_prompt_is_private(llm):
    secret_prompt = "You are Carol's private diary assistant. " * 4
    chat = conversation(secret_prompt, "What did I write yesterday about the garden?")
    llm.chat(chat, ONE, user="carol")
    assert llm.chat(chat, ONE, user="dave")[0].num_cached_tokens == 0
    assert llm.chat(chat, ONE, user="carol")[0].num_cached_tokens > 0


def test_single_tenant_shares_everything(llm):
    chat = conversation("You are terse. " * 6, "Say yes.")
    llm.chat(chat, ONE)
    assert llm.chat(chat, ONE)[0].num_cached_tokens > 0


def test_shipped_personas_are_registered(llm):
    assert "assistant" in llm.engine.personas and len(llm.engine.personas) >= 6
    with pytest.raises(ValueError, match="system prompt"):
        llm.register_persona("empty", "  ")
