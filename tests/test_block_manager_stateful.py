"""Hypothesis drives random add / step / abort / fork / finish sequences through the scheduler and
block manager (no model) and checks the invariants after every step."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chatengine.config import EngineConfig
from chatengine.engine.kv.block_manager import BlockManager
from chatengine.engine.scheduler import Scheduler
from chatengine.engine.sequence import Sequence, SequenceStatus
from chatengine.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True, root=b"root")
        self.sched = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=10, max_num_seqs=4), self.bm)
        self.live: list[Sequence] = []
        self.in_flight = None  # (step, sampled sequences): launched, values not back yet

    # prompts from a tiny alphabet with shared beginnings, so prefixes hit often
    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=9),
        user=st.sampled_from([b"", b"u1", b"u2"]),
    )
    def add(self, prefix, tail, user):
        seq = Sequence(prefix + tail, SamplingParams(), block_size=BS)
        seq.salt, seq.public_prefix_len = user, len(prefix)
        self.sched.add(seq)
        self.live.append(seq)

    @rule(token=st.integers(0, 3), max_len=st.integers(6, 30), overlap=st.booleans())
    def step(self, token, max_len, overlap):
        """Schedule and launch a step; complete the one before (overlap: async scheduling) or this one."""
        out = self.sched.schedule()
        sampled = [s for s, n in zip(out.seqs, out.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
        self.sched.launched(out)
        done, self.in_flight = self.in_flight, (out, sampled)
        if done is not None:
            self._complete(*done, token, max_len)
        if not overlap:
            done, self.in_flight = self.in_flight, None
            self._complete(*done, token, max_len)

    def _complete(self, out, sampled, token, max_len):
        sampled = [s for s in sampled if s.status != SequenceStatus.FINISHED]
        for seq in sampled:
            seq.fill_placeholder(token)
        self.sched.publish(out)
        for seq in sampled:
            if seq.num_known_tokens >= max_len:
                self._finish(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        self._finish(self.live[i % len(self.live)])

    @precondition(lambda self: any(s.status == SequenceStatus.RUNNING and s.num_computed_tokens > 1 for s in self.live))
    @rule(i=st.integers(0, 100), back=st.integers(0, 5))
    def fork(self, i, back):
        parents = [s for s in self.live if s.status == SequenceStatus.RUNNING and s.num_computed_tokens > 1]
        parent = parents[i % len(parents)]
        num_tokens = max(1, min(parent.num_computed_tokens, parent.num_known_tokens - 1) - back)
        child = Sequence(parent.token_ids[: num_tokens + 1], SamplingParams(), block_size=BS)
        child.salt, child.public_prefix_len = parent.salt, parent.public_prefix_len
        free_before = self.bm.num_free_blocks
        try:
            copy = self.bm.fork(parent, child, num_tokens)
        except MemoryError:
            assert self.bm.num_free_blocks == free_before == 0 and child.block_table == []
            return
        assert child.block_table[: num_tokens // BS] == parent.block_table[: num_tokens // BS]
        if num_tokens % BS:
            assert copy == (parent.block_table[num_tokens // BS], child.block_table[-1])
            assert self.bm.blocks[child.block_table[-1]].ref_count == 1
        else:
            assert copy is None
        self.sched.add_running(child)
        self.live.append(child)

    def _finish(self, seq):
        self.sched.finish(seq)
        self.live.remove(seq)

    @invariant()
    def consistent(self):
        self.bm.check_invariants(self.live)
        used = sum(1 for b in self.bm.blocks if b.ref_count > 0)
        assert used + self.bm.num_free_blocks == NUM_BLOCKS  # conservation
        for seq in self.live:  # tables cover the computed KV
            assert len(seq.block_table) * BS >= seq.num_computed_tokens

    def teardown(self):
        if self.in_flight is not None:
            self._complete(*self.in_flight, 0, 1 << 30)
        for seq in list(self.live):
            self._finish(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS  # drains to zero used
        self.bm.check_invariants([])


EngineMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestEngineMachine = EngineMachine.TestCase
