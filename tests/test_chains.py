"""RouterChains: the router's per-user hash chains, started from each user's recent ones."""

from chatengine.engine.kv.hashing import extend_chain, salt_extra, user_salt
from chatengine.engine.replicas.chains import ROOT, RouterChains

SECRET, BS = b"s" * 32, 4


def fresh(ids, user, first):
    extra = salt_extra(user_salt(SECRET, user)) if user is not None else b""
    hashes: list[bytes] = []
    extend_chain(hashes, ROOT, ids, BS, len(ids) // BS, first, extra)
    return hashes


def test_a_prompts_chain_is_the_one_hashed_from_scratch_salted_per_user():
    chains = RouterChains(SECRET, BS)
    ids = list(range(1, 23))  # 5 full blocks and a partial one
    a = chains.of_prompt(ids, "alice", 2)
    assert a.hashes == fresh(ids, "alice", 2) and len(a.hashes) == 5
    b = chains.of_prompt(ids, "bob", 2)
    assert b.hashes[:2] == a.hashes[:2]  # the public blocks (a persona's) alike
    assert not set(b.hashes[2:]) & set(a.hashes[2:])
    assert chains.of_prompt(ids, None, 0).hashes == fresh(ids, None, 0)


def test_the_next_turn_starts_from_the_answered_chain():
    chains = RouterChains(SECRET, BS)
    prompt = list(range(1, 11))  # 2 full blocks, 2 tokens over
    chain = chains.of_prompt(prompt, "alice", 0)
    answered = prompt + [50, 51, 52, 53, 54, 55]  # the answer completes blocks 2 and 3
    held = chains.of_answer(chain, answered)
    whole = fresh(answered, "alice", 0)
    assert held == whole[2:4] and len(chain.hashes) == 2  # the prompt's own chain is left as it was
    turn = answered + [60, 61, 62, 63, 64]
    nxt = chains.of_prompt(turn, "alice", 0)
    assert nxt.hashes == fresh(turn, "alice", 0)
    # taken from the answered chain, not hashed again: the very same objects
    memo = chains._memos["alice"][1]
    remembered = next(hs for toks, hs, _, _ in memo.entries if toks == answered)
    assert all(x is y for x, y in zip(nxt.hashes[:4], remembered))
    # another user's turn with the same tokens reuses none of alice's private hashes
    assert chains.of_prompt(turn, "bob", 0).hashes == fresh(turn, "bob", 0)


def test_users_beyond_the_bound_are_dropped_oldest_first_and_forget_drops_one():
    chains = RouterChains(SECRET, BS, users=2)
    for user in ("a", "b", "a", "c"):  # a seen again: b is the least recent
        chains.of_prompt(list(range(1, 9)), user, 0)
    assert list(chains._memos) == ["a", "c"]
    chains.forget("a")
    assert list(chains._memos) == ["c"]
    chains.forget("nobody")  # nothing to drop: no error


def test_a_forgotten_user_stays_forgotten_when_a_running_turn_finishes():
    chains = RouterChains(SECRET, BS)
    prompt = list(range(1, 11))
    chain = chains.of_prompt(prompt, "alice", 0)
    chains.forget("alice")
    held = chains.of_answer(chain, prompt + [50, 51, 52, 53, 54, 55])
    assert held == fresh(prompt + [50, 51, 52, 53, 54, 55], "alice", 0)[2:4]  # the router still learns
    assert "alice" not in chains._memos and chains._held == 0


def test_the_answered_chain_replaces_its_prompts_and_tokens_are_bounded():
    chains = RouterChains(SECRET, BS, tokens=40)
    prompt = list(range(1, 11))
    chain = chains.of_prompt(prompt, "alice", 0)
    chains.of_answer(chain, prompt + [50, 51, 52, 53, 54, 55])
    memo = chains._memos["alice"][1]
    assert [len(toks) for toks, _, _, _ in memo.entries] == [16] and chains._held == 16
    chains.of_prompt(list(range(100, 130)), "bob", 0)  # 30 more: over 40, alice (the oldest) goes
    assert list(chains._memos) == ["bob"] and chains._held == 30


def test_a_caller_changing_its_prompt_list_changes_nothing_remembered():
    chains = RouterChains(SECRET, BS)
    prompt = list(range(1, 11))
    chains.of_prompt(prompt, "alice", 0)
    prompt[4:8] = [20, 21, 22, 23]  # the caller's list, changed in place after the request
    again = [1, 2, 3, 4, 20, 21, 22, 23, 9, 10]  # would match the changed list's two blocks
    assert chains.of_prompt(again, "alice", 0).hashes == fresh(again, "alice", 0)
