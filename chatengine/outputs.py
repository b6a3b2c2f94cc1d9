"""RequestOutput and CompletionOutput: what generate / chat / AsyncLLM return."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it, if any
    # with SamplingParams.logprobs: per generated token {token_id: logprob}, the top candidates best
    # first, then the sampled token when it is not among them (so token_ids[i] is always a key)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    arrival_time: float = 0.0  # time.monotonic() when the engine accepted the request
    first_token_time: float | None = None  # time.monotonic() of its first generated token
    # with SamplingParams.prompt_logprobs: per prompt token, as CompletionOutput.logprobs (None for
    # the first token, which nothing predicts)
    prompt_logprobs: list[dict[int, float] | None] | None = None
