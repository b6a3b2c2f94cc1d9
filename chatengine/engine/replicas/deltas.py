"""What a replica sends of each output: only what is new since the last one.

A RequestOutput is cumulative (every token so far); pickling it every step would cost a stream of
n tokens O(n^2) on both ends of the pipe. The replica sends a Delta per request per step, and the
API process rebuilds the cumulative RequestOutput that AsyncLLM would have given.

Deltas are plain tuples: a step's list of them pickles and unpickles in C, with no class to look up
and call per delta (a dataclass cost the API process ~4x as much to unpickle, 2.3 us a delta, and
the replica ~6x as much to pickle). The API process applies each delta at once (appends), but
builds a RequestOutput only when its reader asks for one: a reader slower than the engine takes the
newest output only, so the ones it skips are never made.
"""

from array import array

from chatengine.outputs import CompletionOutput, ListView, RequestOutput, TokenLogprobs

# (index, new token ids, characters of the text kept, text added, finish_reason, stop_reason,
#  new logprobs or None, cumulative logprob); the engine's logprobs (TokenLogprobs) travel as
#  (k, their flat float32s as bytes): dicts cost ~2 us a token to build and pickle in the replica
#  and as much to unpickle here, and an array ~1 us a request (a reconstructor call each way)
CompletionDelta = tuple
# (request_id, finished, error, num_cached_tokens, arrival_time, first_token_time,
#  [CompletionDelta], new prompt logprobs or None)
Delta = tuple


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
            logprobs = _new_logprobs(c.logprobs, num_tokens)
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
        return (
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
    """The API process's end, one per request: deltas in (`add`), cumulative RequestOutputs out
    (`output`), each a snapshot that does not change as later deltas arrive. Used on one thread
    (its caller's event loop): it holds no lock."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self._completions: dict[int, _Completion] = {}
        self._prompt_logprobs: list | None = None
        self._head: tuple = (0, False, None, 0.0, None)  # num_cached_tokens, finished, error, times
        self.finished = False
        self.count = 0  # deltas added

    def add(self, delta: Delta) -> bool:
        """Apply a delta (appends only: O(what it adds)); True if the request has finished."""
        request_id, finished, error, cached, arrival, first, completions, prompt_logprobs = delta
        for index, ids, keep, text, finish, stop, logprobs, cumulative in completions:
            c = self._completions.get(index)
            if c is None:
                c = self._completions[index] = _Completion()
            c.token_ids += ids
            if keep == len(c.text):
                c.text += text
            else:  # a stop string's held-back text let go, or cut
                c.text = c.text[:keep] + text
            c.finish_reason, c.stop_reason, c.cumulative_logprob = finish, stop, cumulative
            if isinstance(logprobs, tuple):  # flat rows: float32 bytes
                k, rows = logprobs
                c.flat = c.flat if c.flat is not None else array("f")
                c.flat.frombytes(rows)
                c.k = k
            elif logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs += logprobs
        if prompt_logprobs is not None:
            if self._prompt_logprobs is None:
                self._prompt_logprobs = []
            self._prompt_logprobs += prompt_logprobs
        self._head = (cached, finished, error, arrival, first)
        self.finished = finished
        self.count += 1
        return finished

    def output(self) -> RequestOutput:
        """The cumulative output of what was added so far."""
        return self.output_and_count()[0]

    def output_and_count(self) -> tuple[RequestOutput, int]:
        """The output, and how many deltas it holds."""
        cached, finished, error, arrival, first = self._head
        prompt_logprobs = self._prompt_logprobs
        out = RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [c.snapshot(index) for index, c in sorted(self._completions.items())],
            cached,
            finished,
            error,
            arrival,
            first,
            _Prefix(prompt_logprobs, len(prompt_logprobs)) if prompt_logprobs is not None else None,
        )
        return out, self.count

    def apply(self, delta: Delta) -> RequestOutput:
        """add, then output."""
        self.add(delta)
        return self.output()

    def token_ids(self, index: int = 0) -> list[int]:
        c = self._completions.get(index)
        return list(c.token_ids) if c is not None else []


def _new_logprobs(logprobs, num_tokens: int):
    """The engine's TokenLogprobs as flat rows; any other sequence of dicts as its new dicts."""
    if logprobs is None:
        return None
    if isinstance(logprobs, TokenLogprobs):
        return logprobs.rows_from(num_tokens)
    return logprobs[num_tokens:]


class _Completion:
    __slots__ = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs", "flat", "k", "cumulative_logprob")

    def __init__(self) -> None:
        self.text: str = ""
        self.token_ids: list[int] = []
        self.finish_reason = self.stop_reason = self.cumulative_logprob = None
        self.logprobs: list | None = None  # dicts, as they came
        self.flat: array | None = None  # or the engine's flat rows of k candidates (TokenLogprobs)
        self.k = 0

    def snapshot(self, index: int) -> CompletionOutput:
        """Callers may keep an output while the next one grows: the ids are copied, the logprobs (a
        list or an array only ever appended to) are viewed up to their length now."""
        logprobs = self.logprobs
        view: ListView | None
        if self.flat is not None:
            view = TokenLogprobs(self.flat, self.k, len(self.flat) // (2 + 2 * self.k))
        else:
            view = _Prefix(logprobs, len(logprobs)) if logprobs is not None else None
        return CompletionOutput(
            index,
            self.text,
            list(self.token_ids),
            self.finish_reason,
            self.stop_reason,
            view,
            self.cumulative_logprob,
        )


class _Prefix(ListView):
    """The first n items of a list that is only ever appended to: a snapshot that costs no copy
    (a stream's logprobs would otherwise be copied whole for every chunk, O(n^2) in a long reply).
    Slicing gives a list; equal to any sequence of the same items; + concatenates; pickles as a list."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int):
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._items[start:stop:step]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("index out of range")
        return self._items[i]

    def __iter__(self):
        return iter(self._items[: self._n])

    def __repr__(self) -> str:
        return repr(list(self))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
