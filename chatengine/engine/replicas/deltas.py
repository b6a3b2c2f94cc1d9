"""What a replica sends of each output: only what is new since the last one.

A RequestOutput is cumulative (every token so far); pickling it every step would cost a stream of
n tokens O(n^2) on both ends of the pipe. The replica sends a Delta per request per step, and the
API process rebuilds the cumulative RequestOutput that AsyncLLM would have given.
"""

from dataclasses import dataclass

from chatengine.outputs import CompletionOutput, RequestOutput

# (index, new token ids, characters of the text kept, text added, finish_reason, stop_reason,
#  new logprobs or None, cumulative logprob)
CompletionDelta = tuple


@dataclass(slots=True)
class Delta:
    request_id: str
    finished: bool
    error: str | None
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    completions: list[CompletionDelta]
    new_prompt_logprobs: list | None


class DeltaEncoder:
    """The replica's end: remembers what it sent of each running request."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, str]]] = {}  # request -> index -> (tokens, text)

    def encode(self, out: RequestOutput) -> Delta:
        sent = self._sent.setdefault(out.request_id, {})
        completions = []
        for c in out.outputs:
            num_tokens, text = sent.get(c.index, (0, ""))
            keep = len(text) if c.text.startswith(text) else _common_prefix(c.text, text)
            logprobs = c.logprobs[num_tokens:] if c.logprobs is not None else None
            completions.append(
                (c.index, c.token_ids[num_tokens:], keep, c.text[keep:], c.finish_reason, c.stop_reason, logprobs,
                 c.cumulative_logprob)
            )  # fmt: skip
            sent[c.index] = (len(c.token_ids), c.text)
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            done = sent.get(-1, (0, ""))[0]
            prompt_logprobs = out.prompt_logprobs[done:]
            sent[-1] = (len(out.prompt_logprobs), "")
        if out.finished:
            del self._sent[out.request_id]
        return Delta(
            out.request_id,
            out.finished,
            out.error,
            out.num_cached_tokens,
            out.arrival_time,
            out.first_token_time,
            completions,
            prompt_logprobs,
        )


class OutputAssembler:
    """The API process's end, one per request: deltas in, cumulative RequestOutputs out."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self._completions: dict[int, CompletionOutput] = {}
        self._prompt_logprobs: list | None = None

    def apply(self, delta: Delta) -> RequestOutput:
        for index, ids, keep, text, finish, stop, logprobs, cumulative in delta.completions:
            c = self._completions.get(index)
            if c is None:
                c = self._completions[index] = CompletionOutput(index, "", [])
            c.token_ids += ids
            c.text = c.text[:keep] + text
            c.finish_reason, c.stop_reason, c.cumulative_logprob = finish, stop, cumulative
            if logprobs is not None:
                c.logprobs = (c.logprobs or []) + logprobs
        if delta.new_prompt_logprobs is not None:
            self._prompt_logprobs = (self._prompt_logprobs or []) + delta.new_prompt_logprobs
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [_copy(c) for _, c in sorted(self._completions.items())],
            delta.num_cached_tokens,
            delta.finished,
            delta.error,
            delta.arrival_time,
            delta.first_token_time,
            list(self._prompt_logprobs) if self._prompt_logprobs is not None else None,
        )

    def token_ids(self, index: int = 0) -> list[int]:
        c = self._completions.get(index)
        return list(c.token_ids) if c is not None else []


def _copy(c: CompletionOutput) -> CompletionOutput:
    """A snapshot: callers may keep an output while the next one grows."""
    logprobs = list(c.logprobs) if c.logprobs is not None else None
    return CompletionOutput(
        c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, logprobs, c.cumulative_logprob
    )


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
