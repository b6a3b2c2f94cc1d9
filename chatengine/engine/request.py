"""A request: one prompt, its sampling parameters and its n sequences (samples)."""

import time

from chatengine.engine.sequence import Sequence
from chatengine.engine.tokenizer import IncrementalDetokenizer
from chatengine.sampling_params import SamplingParams


class Request:
    """One prompt and its n samples (sequences)."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, user: str | None
    ):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.user = params, user
        self.stop_token_ids = frozenset(params.stop_token_ids or ())  # checked for every sampled token
        self.seqs: list[Sequence] = []
        self.detoks: list[IncrementalDetokenizer] = []
        self.error: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_finished = 0  # sequences finished so far (counted by LLMEngine._finish)
        self.stream = True  # False: step() returns its output only once it has finished
        self.held_steps: int | None = None  # streaming: steps since its last output (None: none yet)
        self.grammar = None  # the compiled structured-output grammar its sequences follow
        # with params.prompt_logprobs: per prompt token so far (none predicts the first)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        # read for every request every step: a count, not a scan of the sequences
        return self.num_finished == self.params.n
