"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

Each step has one budget of `max_num_batched_tokens`. Running sequences go first, oldest first:
each gets one decode token or its next prefill chunk. Then waiting sequences are admitted, with a
prefix-cache lookup, while budget, `max_num_seqs` and free blocks last: first come first served
among one user's, and across users round-robin, fewest running first (a user is a prefix-cache salt),
so one user's flood of requests never queues another's behind it. Prefill chunks and
decodes share a step, so one user's long prompt never freezes everyone else's stream. A step runs at
most `max_num_seqs` sequences; a request of n > 1 samples, one sequence until its first token, keeps
room at admission for the samples it then forks (as far as there is room). When blocks
run out, a running sequence is preempted, the newest of the user with the most running: its blocks
are freed (they keep their hashes, so it usually hits them again) and it goes back to the head of
the queue to be recomputed.

With async scheduling the engine schedules step N+1 before it knows the tokens step N sampled: those
are placeholders (sequence.PLACEHOLDER) whose KV the next step computes from the device-side ids. A
sequence whose pending token ends it by length is not scheduled again; one that a pending token ends
by EOS or a stop string costs one wasted lane, found when the values arrive. A sequence whose
sampling reads its tokens on the host (a grammar, penalties, min_tokens) is not scheduled while its
last token is in flight when plain sequences run beside it: it takes at most every other step, and
theirs keep overlapping; with async scheduling a grammar's also waits for its next mask, filled on a
worker thread meanwhile.
When every running sequence is such a one, they run on their placeholders and the engine collects
the step in flight before their sampling.
"""

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from chatengine.config import EngineConfig
from chatengine.engine.kv.block_manager import BlockManager
from chatengine.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens to compute per sequence
    num_preempted: int = 0
    preempted: list[Sequence] = field(default_factory=list)  # sent back to wait, this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len or config.max_model_len or 1 << 62
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.wait_for_masks = False  # a grammar row sits out while its next mask is being made (engine)
        self.num_reserved = 0  # places kept for the samples that running sequences will fork
        # keep ~1% of the pool free at admission so a new prompt does not force a preemption at once
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue seq: last, or (`first`) ahead of every other (a forked sample of a running request)."""
        if first:
            self.waiting.appendleft(seq)
        else:
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

        # running first: a decode token, or the next chunk of an unfinished prefill. At most
        # max_num_seqs of them a step: forked samples of n > 1 join the running set beyond it, and
        # the model runner's per-sequence buffers (and CUDA graphs) hold max_num_seqs rows. Those
        # beyond wait, oldest first, until an older sequence finishes
        others_overlap = any(not seq.params.needs_history for seq in self.running)
        i = 0
        while i < len(self.running) and budget > 0 and len(out.seqs) < self.max_num_seqs:
            seq = self.running[i]
            if (
                seq.params.needs_history
                and others_overlap
                and (seq.num_pending or (self.wait_for_masks and _mask_in_making(seq)))
            ):
                # its sampling reads the token still in flight, or its grammar's next mask still being
                # filled (structured.fill_ahead): it sits this step out, so the plain rows' step never
                # waits for that token to reach the host or for that mask
                i += 1
                continue
            if seq.num_pending and (
                seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
            ):
                i += 1  # its pending token ends it (length): nothing to compute
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate(seq, num_new):
                victim = self._victim(i)
                self._preempt(victim)
                out.num_preempted += 1
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # then admit waiting sequences, in _fair_order; one whose cached prefix is still
        # coming from disk waits at the head without holding up the others. A request of n > 1
        # samples keeps room, as far as there is some, for the n - 1 it forks once its first token
        # is drawn (`forked` gives it back), so its samples seldom wait behind the step's cap above
        # and later requests do not take their places; it is admitted whenever it fits alone
        loading = []
        free = self.max_num_seqs - len(self.running) - self.num_reserved
        if budget > 0 and not out.num_preempted and (free > 0 or not self.running):
            self._fair_order(max(free, 1))
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            free = self.max_num_seqs - len(self.running) - self.num_reserved
            if self.running and free < 1:
                break
            will_fork = seq.params.n - 1 if seq.index == 0 and seq.num_tokens == seq.num_prompt_tokens else 0
            will_fork = min(will_fork, free - 1)
            cached, num_restore, from_disk = bm.lookup(seq)
            if from_disk:
                loading.append(self.waiting.popleft())
                continue
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
            seq.num_reserved = will_fork
            self.num_reserved += will_fork
        self.waiting.extendleft(reversed(loading))
        return out

    def _fair_order(self, places: int) -> None:
        """The `places` waiting sequences to admit first, moved to the head in that order. A user's
        k-th waiting sequence (k from 0) ranks at k + the number that user has running, ties in
        queue order: round-robin over the users, those with the fewest running first. The others
        keep their order, as does one user's queue alone. (O(waiting) a step with room to admit.)"""
        if len(self.waiting) < 2 or len({s.salt for s in self.waiting}) < 2:
            return
        running = Counter(s.salt for s in self.running)
        queued: Counter = Counter()
        ranked = []  # only a user's first `places` can be among the first `places` overall
        for place, s in enumerate(self.waiting):
            k = queued[s.salt]
            if k < places:
                ranked.append((running[s.salt] + k, place))
            queued[s.salt] = k + 1
        first = [place for _, place in heapq.nsmallest(places, ranked)]
        chosen = set(first)
        rest = [s for place, s in enumerate(self.waiting) if place not in chosen]
        self.waiting = deque([self.waiting[place] for place in first] + rest)

    def _victim(self, start: int) -> Sequence:
        """The sequence to preempt, taken out of `running`: among those not scheduled yet this step
        (running[start:]), the newest of the user with the most sequences running, so that a user
        with many gives way before one with few."""
        at = len(self.running) - 1
        if len({s.salt for s in self.running[start:]}) > 1:
            running = Counter(s.salt for s in self.running)
            most = max(running[s.salt] for s in self.running[start:])
            while running[self.running[at].salt] < most:
                at -= 1
        return self.running.pop(at)

    def check_invariants(self) -> None:
        """The kept places are those of running sequences (debug_checks: every step)."""
        assert self.num_reserved == sum(s.num_reserved for s in self.running), "kept places out of step"
        assert not any(s.num_reserved for s in self.waiting), "a waiting sequence keeps places"

    def forked(self, seq: Sequence) -> None:
        """seq's samples have forked (or it will never fork: preempted, finished): the places kept
        for them at its admission are free again."""
        self.num_reserved -= seq.num_reserved
        seq.num_reserved = 0

    def _preempt(self, seq: Sequence) -> None:
        self.forked(seq)  # admitted again, it keeps room again if it has not forked by then
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def launched(self, out: SchedulerOutput) -> None:
        """The step's forward is queued: its tokens count as computed (the next schedule builds on
        them), and a sequence whose chunk reaches its end gets a placeholder for the token it samples."""
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                seq.append_placeholder()
            seq.num_computed_tokens += num_new

    def publish(self, out: SchedulerOutput) -> None:
        """The step's sampled values have arrived: publish blocks that became full. (Their KV may be
        written by a step still in flight; anything that reads them runs after it on the stream.)"""
        for seq in out.seqs:
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted sequence, wherever it is, and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.forked(seq)
        self.block_manager.free(seq)
        seq.drop_placeholders()
        seq.status = SequenceStatus.FINISHED


def _mask_in_making(seq: Sequence) -> bool:
    return seq.grammar is not None and seq.grammar.filling()
