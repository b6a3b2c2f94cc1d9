"""RequestOutput and CompletionOutput: what generate / chat / AsyncLLM return."""

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field


class ListView(Sequence):
    """A read-only sequence that stands in for the list of its items: equal to any sequence of the
    same items, + concatenates into a list, pickles as a list (subclasses give __len__, __getitem__)."""

    __slots__ = ()

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __reduce__(self):
        return (list, (list(self),))


class TokenLogprobs(ListView):
    """A sequence's generated tokens' logprobs, read as one {token_id: logprob} dict per token (the
    top k candidates best first, then the token when it is not among them).

    Stored flat: row i is `2 + 2k` floats of `flat` (token, its logprob, k values, k ids). The engine
    appends a row a token and hands out views of the first n rows, so a step builds no dicts and
    copies no lists that nobody may read; a reader pays for the rows it reads (the HTTP API: the new
    ones of each chunk). Rows are only ever appended, so a view never changes. Indexing gives a
    dict, slicing a list of dicts, + a list; equal to any sequence of the same dicts; pickles as a list."""

    __slots__ = ("_flat", "_k", "_n")

    def __init__(self, flat: array, k: int, n: int):
        self._flat, self._k, self._n = flat, k, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("logprobs index out of range")
        return self._row(i)

    def _row(self, i: int) -> dict[int, float]:
        k, f = self._k, self._flat
        at = i * (2 + 2 * k)
        d = dict(zip(map(int, f[at + 2 + k : at + 2 + 2 * k]), f[at + 2 : at + 2 + k]))
        d.setdefault(int(f[at]), f[at + 1])
        return d

    def rows_from(self, i: int) -> tuple[int, bytes]:
        """Rows i.. of this view as (k, their flat float32s as bytes): what a replica sends of new
        tokens, to be viewed again on the other end (no dicts made or pickled on either, and bytes
        pickle as they are, where an array goes through a reconstructor call each way)."""
        width = 2 + 2 * self._k
        return self._k, memoryview(self._flat)[i * width : self._n * width].tobytes()

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(self)!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it, if any
    # with SamplingParams.logprobs: per generated token {token_id: logprob}, the top candidates best
    # first, then the sampled token when it is not among them (so token_ids[i] is always a key)
    logprobs: Sequence[dict[int, float]] | None = None  # a TokenLogprobs from the engine
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
    prompt_logprobs: Sequence[dict[int, float] | None] | None = None
