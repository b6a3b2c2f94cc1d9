"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

Each step has one budget of `max_num_batched_tokens`. Running sequences go first, oldest first:
each gets one decode token or its next prefill chunk. Then waiting sequences are admitted FCFS,
with a prefix-cache lookup, while budget, `max_num_seqs` and free blocks last. Prefill chunks and
decodes share a step, so one user's long prompt never freezes everyone else's stream. When blocks
run out, the newest running sequence is preempted: its blocks are freed (they keep their hashes,
so it usually hits them again) and it goes back to the head of the queue to be recomputed.
"""
from collections import deque
from dataclasses import dataclass, field

from chatengine.block_manager import BlockManager
from chatengine.config import EngineConfig
from chatengine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # tokens to compute per sequence
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # admission order: oldest first
        self.num_preemptions = 0
        # keep ~1% of the pool free at admission so a new prompt does not force a preemption at once
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence that already holds its blocks joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # running first: a decode token, or the next chunk of an unfinished prefill
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate(seq, num_new):
                victim = self.running.pop()             # the newest
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # then admit waiting sequences, first come first served
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            cached, num_restore = bm.lookup(seq)
            num_hit_tokens = (len(cached) + num_restore) * bm.block_size
            num_new = min(seq.num_tokens - num_hit_tokens, budget)
            need = bm.num_blocks_for(num_hit_tokens + num_new) - len(cached)
            if self.running and bm.num_free_blocks - need < self.watermark_blocks:
                break
            if not bm.allocate(seq, num_new, cached, num_restore):
                break
            bm.count_prefix_hit(seq, num_hit_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the forward: advance computed counts and publish blocks that became full."""
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted sequence, wherever it is, and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
