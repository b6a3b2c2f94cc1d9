"""Scheduler without a model: token budget, chunked prefill mixed with decodes, FCFS within a user and
round-robin across users, preemption."""

from chatengine.config import EngineConfig
from chatengine.engine.kv.block_manager import BlockManager
from chatengine.engine.scheduler import Scheduler
from chatengine.engine.sequence import Sequence, SequenceStatus
from chatengine.sampling_params import SamplingParams, StructuredOutputs

BS = 4


def make(num_blocks=16, budget=8, max_seqs=8):
    config = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching=False))


def seq(n, start=0):
    return Sequence(list(range(start, start + n)), SamplingParams(), block_size=BS)


def step(sched):
    """Schedule, pretend to run, advance; sequences that reach their end get one new token."""
    out = sched.schedule()
    sched.launched(out)
    for s in out.seqs:
        if s.num_pending:
            s.fill_placeholder(7)
    sched.publish(out)
    return [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens)], out


def test_chunked_prefill_respects_the_budget():
    sched = make(budget=8)
    a = seq(20)
    sched.add(a)
    assert step(sched)[0] == [(a.seq_id, 8)]
    assert step(sched)[0] == [(a.seq_id, 8)]
    assert step(sched)[0] == [(a.seq_id, 4)]  # the last chunk samples
    assert a.num_tokens == 21
    assert step(sched)[0] == [(a.seq_id, 1)]  # then decodes


def test_prefill_chunks_mix_with_decodes_fcfs():
    sched = make(budget=8)
    a, b, c = seq(3), seq(30, 100), seq(5, 200)
    for s in (a, b, c):
        sched.add(s)
    got, _ = step(sched)
    assert got == [(a.seq_id, 3), (b.seq_id, 5)]  # a whole, b's first chunk, c waits
    got, _ = step(sched)
    assert got == [(a.seq_id, 1), (b.seq_id, 7)]  # a decodes beside b's next chunk
    assert c.status == SequenceStatus.WAITING


def test_max_num_seqs():
    sched = make(budget=64, max_seqs=2)
    seqs = [seq(2, 10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    got, _ = step(sched)
    assert [i for i, _ in got] == [seqs[0].seq_id, seqs[1].seq_id]


def test_a_step_runs_at_most_max_num_seqs_of_the_running_ones():
    # forked samples of n > 1 join the running set beyond max_num_seqs (engine: add_running); a
    # step takes the oldest max_num_seqs of them, and one that sits out leaves its place to the next
    sched = make(num_blocks=32, budget=64, max_seqs=2)
    seqs = [seq(2, 10 * i) for i in range(4)]
    sched.add(seqs[0])
    step(sched)
    for s in seqs[1:]:  # as forks: running without admission
        sched.block_manager.allocate(s, s.num_tokens)
        sched.add_running(s)
    got, _ = step(sched)
    assert [i for i, _ in got] == [seqs[0].seq_id, seqs[1].seq_id]
    sched.finish(seqs[0])
    got, _ = step(sched)
    assert [i for i, _ in got] == [seqs[1].seq_id, seqs[2].seq_id]


def fork(sched, parent, count):
    """What the engine does once parent's first token is drawn: its samples join running."""
    sched.forked(parent)
    children = []
    for i in range(1, count + 1):
        child = Sequence(list(parent.token_ids), parent.params, index=i, block_size=BS)
        child.num_computed_tokens = parent.num_computed_tokens
        assert sched.block_manager.allocate(child, child.num_tokens - child.num_computed_tokens)
        sched.add_running(child)
        children.append(child)
    return children


def test_a_request_of_n_samples_keeps_room_for_its_forks():
    sched = make(num_blocks=64, budget=64, max_seqs=4)
    a = Sequence(list(range(4)), SamplingParams(n=3), block_size=BS)  # forks 2 more after its first token
    b, c = seq(2, 10), seq(2, 20)
    for s in (a, b, c):
        sched.add(s)
    got, _ = step(sched)
    assert [i for i, _ in got] == [a.seq_id, b.seq_id]  # a, b and 2 places kept for a's samples
    assert c.status == SequenceStatus.WAITING and sched.num_reserved == 2
    a1, a2 = fork(sched, a, 2)
    assert sched.num_reserved == 0
    got, _ = step(sched)
    assert [i for i, _ in got] == [a.seq_id, b.seq_id, a1.seq_id, a2.seq_id]  # c still waits: 4 run
    assert c.status == SequenceStatus.WAITING
    sched.check_invariants()


def test_a_request_of_n_samples_is_admitted_whenever_it_fits_alone():
    # no head-of-line blocking: with 2 of 4 places taken, a request of 3 samples is admitted at once
    # and keeps the 1 place left for one of its samples; the other waits its turn in the steps
    sched = make(num_blocks=64, budget=64, max_seqs=4)
    x, y = seq(2), seq(2, 10)
    sched.add(x)
    sched.add(y)
    step(sched)
    b = Sequence(list(range(30, 34)), SamplingParams(n=3), block_size=BS)
    c = seq(2, 40)
    sched.add(b)
    sched.add(c)
    got, _ = step(sched)
    assert b.seq_id in [i for i, _ in got] and sched.num_reserved == 1 and c.status == SequenceStatus.WAITING
    # more samples than max_num_seqs, alone: admitted, keeping what there is (3 places)
    alone = make(num_blocks=64, budget=64, max_seqs=4)
    big, after = Sequence(list(range(4)), SamplingParams(n=8), block_size=BS), seq(2, 50)
    alone.add(big)
    alone.add(after)
    assert [i for i, _ in step(alone)[0]] == [big.seq_id]
    assert alone.num_reserved == 3 and after.status == SequenceStatus.WAITING
    alone.check_invariants()


def test_a_request_preempted_before_it_forks_gives_its_room_back_and_keeps_it_again():
    sched = make(num_blocks=64, budget=8, max_seqs=4)
    d = Sequence(list(range(20)), SamplingParams(n=2), block_size=BS)  # 20 tokens: chunks of 8
    sched.add(d)
    step(sched)  # its first chunk: no token drawn yet
    assert sched.num_reserved == 1 and d.num_reserved == 1
    sched.running.remove(d)  # as the scheduler preempts: out of running, then back to wait
    sched._preempt(d)
    assert sched.num_reserved == 0 and d.num_reserved == 0 and d.status == SequenceStatus.WAITING
    sched.check_invariants()
    step(sched)  # admitted again: it has not forked, so it keeps its room again
    assert sched.num_reserved == 1 and d.num_reserved == 1
    sched.check_invariants()


def test_preempts_the_newest_and_recomputes_it():
    sched = make(num_blocks=5, budget=64)
    a, b = seq(7), seq(7, 100)  # 2 blocks each, 1 left (the watermark)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled, 8 tokens each now
    step(sched)  # the 8th tokens fill the 2nd blocks
    assert sched.block_manager.num_free_blocks == 1
    got, out = step(sched)  # a takes the last block; b has none: preempted
    assert out.num_preempted == 1
    assert got == [(a.seq_id, 1)]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1
    assert b.token_ids[-1] == 7  # its generated token is kept for recompute


def user_seq(salt, n, start=0):
    s = seq(n, start)
    s.salt = salt
    return s


def test_one_users_flood_never_queues_anothers_request_behind_it():
    """Admission is round-robin over users, those with the fewest running first; one user's own
    requests keep their order."""
    sched = make(num_blocks=64, budget=64, max_seqs=3)
    eve = [user_seq(b"eve", 2, 10 * i) for i in range(6)]
    bob = user_seq(b"bob", 2, 100)
    for s in [*eve, bob]:
        sched.add(s)
    got, _ = step(sched)
    assert got == [(eve[0].seq_id, 2), (bob.seq_id, 2), (eve[1].seq_id, 2)]
    sched.finish(bob)
    carol = [user_seq(b"carol", 2, 200 + 10 * i) for i in range(2)]
    for s in carol:
        sched.add(s)
    sched.finish(eve[0])  # eve has 1 running, carol none: carol's first goes first, then eve's
    got, _ = step(sched)  # next (a tie with carol's second, which came later)
    assert [sid for sid, n in got if n == 2] == [carol[0].seq_id, eve[2].seq_id]
    assert list(sched.waiting) == [eve[3], eve[4], eve[5], carol[1]]  # the rest in queue order
    sched.finish(eve[1])
    sched.finish(eve[2])  # eve 0 running, carol 1: eve's next; then 1 each, a tie in queue order
    got, _ = step(sched)
    assert [sid for sid, n in got if n == 2] == [eve[3].seq_id, eve[4].seq_id]


def test_preemption_takes_the_newest_of_the_user_with_the_most_running():
    sched = make(num_blocks=7, budget=64)
    eve1, eve2, bob = user_seq(b"eve", 7), user_seq(b"eve", 7, 100), user_seq(b"bob", 7, 200)
    for s in (eve1, eve2, bob):
        sched.add(s)
    step(sched)  # all three prefilled: 2 blocks each, 1 left
    step(sched)  # their 8th tokens fill the 2nd blocks
    got, out = step(sched)  # eve1 takes the last block; eve2, eve's newest, gives way, not bob
    assert out.preempted == [eve2]
    assert got == [(eve1.seq_id, 1), (bob.seq_id, 1)]


def test_a_sequence_preempts_itself_when_it_is_the_only_one():
    sched = make(num_blocks=2, budget=64)
    a = seq(7)
    sched.add(a)
    step(sched)
    step(sched)  # 8 tokens computed: both blocks full
    got, out = step(sched)
    assert got == [] and out.num_preempted == 1 and a.status == SequenceStatus.WAITING


def test_finish_frees_blocks_from_any_state():
    sched = make(budget=4)
    a, b = seq(6), seq(6, 50)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(a)  # running, mid-prefill
    sched.finish(b)  # still waiting
    assert sched.block_manager.num_free_blocks == 16
    assert not sched.has_unfinished()


def test_async_schedule_builds_on_pending_tokens():
    """Step N+1 is scheduled before step N's sampled values are known: the decode runs on the
    placeholder, and a sequence whose pending token reaches max_tokens is not scheduled again."""
    sched = make(budget=8)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=2), block_size=BS)
    sched.add(a)
    out1 = sched.schedule()
    sched.launched(out1)  # prefill queued: its token is pending
    assert a.token_ids == [1, 2, 3, -1] and a.num_pending == 1 and a.num_output_tokens == 0
    out2 = sched.schedule()  # scheduled on the placeholder
    assert [(s.seq_id, n) for s, n in zip(out2.seqs, out2.num_new_tokens)] == [(a.seq_id, 1)]
    sched.launched(out2)
    assert a.token_ids == [1, 2, 3, -1, -1] and a.num_computed_tokens == 4
    assert a.fill_placeholder(9) == 3 and a.output_token_ids == [9]
    assert sched.schedule().seqs == []  # its pending token is its 2nd and last
    assert a.fill_placeholder(8) == 4 and a.output_token_ids == [9, 8]
    sched.finish(a)
    assert a.num_pending == 0 and sched.block_manager.num_free_blocks == 16


def test_a_sequence_that_reads_its_tokens_sits_out_while_one_is_in_flight():
    """A grammar, penalties or min_tokens read every token on the host: such a sequence is scheduled
    only once its last token is back, while a plain one keeps running on its placeholder."""
    sched = make(budget=16)
    plain = Sequence([1, 2, 3], SamplingParams(max_tokens=8), block_size=BS)
    penalized = Sequence([4, 5, 6], SamplingParams(max_tokens=8, presence_penalty=0.5), block_size=BS)
    for s in (plain, penalized):
        sched.add(s)
    sched.launched(sched.schedule())  # both prefills queued: a token pending each
    out = sched.schedule()
    assert out.seqs == [plain]  # the penalized one waits for its token
    sched.launched(out)
    plain.fill_placeholder(7)
    penalized.fill_placeholder(7)  # the first step's tokens arrive
    out = sched.schedule()
    assert out.seqs == [plain, penalized] and penalized.num_pending == 0
    sched.launched(out)
    assert sched.schedule().seqs == [plain]  # and so every other step


def test_a_grammar_row_whose_next_mask_is_still_being_filled_sits_out():
    """A grammar's next mask is filled on a worker thread once its token is in (structured.fill_ahead):
    with async scheduling, while it is, the row sits the step out beside plain rows (their step never
    waits for the fill); alone, it runs (its sampling waits for the mask)."""

    class Grammar:
        making = True

        def filling(self):
            return self.making

    sched = make(budget=16)
    sched.wait_for_masks = True  # (the engine's, with async scheduling)
    plain = Sequence([1, 2, 3], SamplingParams(max_tokens=8), block_size=BS)
    constrained = Sequence(
        [4, 5, 6], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(json_object=True)), block_size=BS
    )
    constrained.grammar = Grammar()
    for s in (plain, constrained):
        sched.add(s)
    sched.launched(sched.schedule())
    plain.fill_placeholder(7)
    constrained.fill_placeholder(7)  # its token is back, but its mask is still being made
    sched.wait_for_masks = False  # step by step, the schedule never depends on a fill's timing
    assert sched.schedule().seqs == [plain, constrained]
    sched.wait_for_masks = True
    out = sched.schedule()
    assert out.seqs == [plain]
    sched.launched(out)
    constrained.grammar.making = False
    assert sched.schedule().seqs == [plain, constrained]  # the mask is made
    constrained.grammar.making = True
    sched.finish(plain)
    assert sched.schedule().seqs == [constrained]  # alone: nothing would overlap


def test_rows_that_read_their_tokens_run_on_placeholders_when_no_plain_row_would_overlap():
    """With nothing plain beside them they run every step (the engine collects the step in flight
    before their sampling): skipping would only leave the device idle."""
    sched = make(budget=16)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=8, min_tokens=4), block_size=BS)
    sched.add(a)
    sched.launched(sched.schedule())
    out = sched.schedule()
    assert out.seqs == [a] and a.num_pending == 1


def test_finishing_with_a_pending_token_drops_it():
    sched = make()
    a = seq(3)
    sched.add(a)
    sched.launched(sched.schedule())
    out = sched.schedule()
    sched.launched(out)
    a.fill_placeholder(5)  # say: EOS, seen one step late
    sched.finish(a)
    assert a.token_ids == [0, 1, 2, 5] and a.output_token_ids == [5]
    sched.publish(out)  # a finished sequence publishes nothing
    assert sched.block_manager.num_free_blocks == 16
