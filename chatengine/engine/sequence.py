"""Sequence: one stream of tokens with its block table. A request is 1..n sequences.

The scheduler and the block manager read and write `block_table`, `num_computed_tokens` and
`status`; the model runner reads them to build the batch. That is where the two sides meet.
"""

from array import array
from enum import Enum, auto
from itertools import count
from typing import Any

from chatengine.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token whose value is still on the device (async scheduling)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(
        self, token_ids: list[int], params: SamplingParams, request_id: str = "", index: int = 0, block_size: int = 16
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index = request_id, index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.num_preemptions = 0
        self.num_reserved = 0  # n > 1: places the scheduler keeps for the samples it will fork
        self.salt = b""  # per-user salt for prefix hashing (set by the engine)
        self.public_prefix_len = 0  # leading tokens shared with everyone (a public persona)
        self.block_hashes: list[bytes] = []  # hashes of full blocks, computed lazily by the block manager
        self.num_published_blocks = 0  # blocks cache_full_blocks has looked at (it only looks further on)
        self.num_pending = 0  # trailing PLACEHOLDER tokens: sampled by a step still in flight
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.generator: Any = None  # per-sequence RNG for seeded sampling (owned by the runner)
        self.seed_key = 0  # seeded: sampler.seed_key(seed, index), the fused sampler's stream
        self.grammar: Any = None  # structured-output state: the engine advances it, the runner masks by it
        self.history: Any = None  # penalties' numpy copy of the known token ids (the logits processor's)
        # per output token, when params.logprobs is set: TokenLogprobs rows (token, logprob, k values, k ids)
        self.logprob_rows = array("f")
        self.cumulative_logprob = 0.0

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_placeholder(self) -> None:
        """A step that samples this sequence was launched: its token joins now, its value later."""
        self.token_ids.append(PLACEHOLDER)
        self.num_pending += 1

    def fill_placeholder(self, token_id: int) -> int:
        """The oldest pending token's value arrived; returns its position."""
        pos = len(self.token_ids) - self.num_pending
        self.token_ids[pos] = token_id
        self.num_pending -= 1
        return pos

    def drop_placeholders(self) -> None:
        """Finished with tokens still pending (a stop seen one step late): they were never its output."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    def __repr__(self):
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.index}, {self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
