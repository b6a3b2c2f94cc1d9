"""Relaying one engine request to an HTTP client: its outputs, cut short when the client goes away,
and the response bodies built from them (one JSON object, or server-sent events).

A client that disconnects (streaming or not) has its engine request aborted at once, which frees its
KV blocks: a watcher task waits for the ASGI `http.disconnect` message. A streamed error after the
headers went out is sent as `data: {"error": ...}` followed by `data: [DONE]`.

A completions request with several prompts is one Job per prompt (one engine request each), relayed
together: choice `prompt_index * n + i`, usage summed. Logprobs are shaped in `logprobs.py`; a
streamed chunk carries those of the tokens it adds.
"""

import asyncio
import json
import logging
import time
from contextlib import aclosing, suppress
from dataclasses import dataclass
from json.encoder import encode_basestring  # json.dumps of one str, ensure_ascii=False

from starlette.requests import Request

from chatengine import AsyncLLM, CompletionOutput, RequestOutput, SamplingParams
from chatengine.app.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from chatengine.app.api.protocol import APIError, Kind
from chatengine.app.api.tools import ToolCalling, ToolStream, assistant_message, finish_reason, stream_deltas

log = logging.getLogger("chatengine.api")

DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True)
class Job:
    """A validated, tokenized request on its way to the engine (one per prompt)."""

    kind: Kind
    request_id: str  # the response's id
    prompt_token_ids: list[int]
    params: SamplingParams
    user: str | None
    model_name: str
    logprobs: int | None = None  # top candidates shown per token (chat: top_logprobs); None: no logprobs
    texts: TokenTexts | None = None  # token strings and bytes, with logprobs
    echo: str | None = None  # completions with echo: the prompt's text, sent before the completion
    generate: bool = True  # False: echo with max_tokens 0, the prompt alone (the one token made is dropped)
    prompt_index: int = 0  # several prompts: this one's place; its choices are prompt_index * n + i
    engine_id: str | None = None  # the engine's request id when it differs from request_id (several prompts)
    tools: ToolCalling | None = None  # chat with tools: how the output becomes tool calls (tools.py)

    @property
    def rid(self) -> str:
        return self.engine_id or self.request_id


# ---- engine outputs -----------------------------------------------------------------------------
_DISCONNECTED, _STOPPED = -1, -2  # what the watcher puts in the inbox in place of a job's index


async def engine_outputs(engine: AsyncLLM, request: Request, jobs: list[Job]):
    """(job, output) pairs from the engine until every job has finished, in the order they come.
    ClientDisconnected when the client goes away, 503 when the engine stops; any early exit aborts
    the unfinished engine requests (AsyncLLM frees their blocks).

    One task per job moves its outputs into one inbox, and a watcher adds the client's disconnect
    and the engine's stop: a token costs one queue hand-off, not a wait on every job. Outputs are
    cumulative, so of several waiting for the same job only the newest is relayed. One job (the
    usual request) reads its stream directly (`_one_job`)."""
    if len(jobs) == 1:
        async with aclosing(_one_job(engine, request, jobs[0])) as outs:
            async for pair in outs:
                yield pair
        return
    inbox: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(engine, job, k, inbox)) for k, job in enumerate(jobs)]
    watcher = asyncio.ensure_future(_watch(engine, request, [j.rid for j in jobs], inbox))
    unfinished = set(range(len(jobs)))
    try:
        while unfinished:
            batch = [await inbox.get()]
            while not inbox.empty():
                batch.append(inbox.get_nowait())
            newest = {k: i for i, (k, _) in enumerate(batch)}
            for i, (k, out) in enumerate(batch):
                if not unfinished:  # all done: a disconnect or a stop after the last output is moot
                    break
                if k == _DISCONNECTED:
                    raise ClientDisconnected()
                if k == _STOPPED:
                    raise APIError(503, "the engine has stopped", type="server_error")
                if isinstance(out, BaseException):
                    raise out
                if out is None or out.finished:
                    unfinished.discard(k)
                if out is None or (not out.finished and newest[k] != i):
                    continue
                yield jobs[k], out
    finally:
        # synchronous first: under cancellation every await below may raise at once
        watcher.cancel()
        for task in pumps:
            task.cancel()
        for k in sorted(unfinished):
            await engine.abort(jobs[k].rid)  # posts to the engine thread; does not suspend
        for task in [*pumps, watcher]:
            await _quietly(task)


class _Signal:
    """What the watcher reports for one job, in place of an inbox: a disconnect or a stop. Either
    interrupts the job's task while it waits for an output (an engine that stopped may send none)."""

    def __init__(self, task: asyncio.Task):
        self.kind: int | None = None
        self.task, self.waiting = task, False

    def put_nowait(self, item: tuple) -> None:
        self.kind = item[0]
        if self.waiting:
            self.task.cancel()

    def check(self) -> None:
        if self.kind == _DISCONNECTED:
            raise ClientDisconnected()
        if self.kind == _STOPPED:
            raise APIError(503, "the engine has stopped", type="server_error")


async def _one_job(engine: AsyncLLM, request: Request, job: Job):
    """engine_outputs for one job: its output stream read here, one queue hand-off a token instead
    of two (a pump task and the inbox cost the API process ~17% of its CPU time a token). Leaving
    early closes the stream, which aborts an unfinished request."""
    task = asyncio.current_task()
    assert task is not None
    signal = _Signal(task)
    watcher = asyncio.ensure_future(_watch(engine, request, [job.rid], signal))  # type: ignore[arg-type]
    stream = engine.generate(job.prompt_token_ids, job.params, request_id=job.rid, user=job.user)
    try:
        async with aclosing(stream) as outs:
            while True:
                signal.check()
                signal.waiting = True
                try:
                    out = await anext(outs)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if signal.kind is None:  # not the watcher's: pass it on
                        raise
                    task.uncancel()
                    signal.check()
                    raise
                finally:
                    signal.waiting = False
                yield job, out
                if out.finished:  # a stop or a disconnect after the last output is moot
                    return
    finally:
        watcher.cancel()
        await _quietly(watcher)


async def _pump(engine: AsyncLLM, job: Job, k: int, inbox: asyncio.Queue) -> None:
    """Job k's outputs into the inbox as (k, output), then (k, None); an error as (k, error).
    Cancelled, it closes the request's stream (which aborts an unfinished request)."""
    try:
        async for out in engine.generate(job.prompt_token_ids, job.params, request_id=job.rid, user=job.user):
            inbox.put_nowait((k, out))
    except Exception as e:
        inbox.put_nowait((k, e))
    else:
        inbox.put_nowait((k, None))


async def _watch(engine: AsyncLLM, request: Request, request_ids: list[str], inbox: asyncio.Queue) -> None:
    """Wait for the client to go away (then abort its engine requests at once: frees their blocks
    even while nobody reads the outputs, e.g. a stream blocked in a send) or for the engine to stop;
    checks the engine every second."""
    receive = asyncio.ensure_future(request.receive())
    try:
        while True:
            done, _ = await asyncio.wait({receive}, timeout=1.0)
            if done:
                if receive.result()["type"] == "http.disconnect":
                    for request_id in request_ids:
                        await engine.abort(request_id)
                    inbox.put_nowait((_DISCONNECTED, None))
                    return
                await asyncio.sleep(0.05)
                receive = asyncio.ensure_future(request.receive())
            if not engine.is_running:
                inbox.put_nowait((_STOPPED, None))
                return
    finally:
        receive.cancel()


async def _quietly(awaitable) -> None:
    """Await for its side effect only: it was cancelled, or the request is over and its end moot."""
    with suppress(BaseException):
        await awaitable


def failure(out: RequestOutput) -> APIError | None:
    """The error to report for a finished output: 500 when the engine failed, 503 when it aborted."""
    if out.error:
        log.error("engine failed request %s: %s", out.request_id, out.error)
        return APIError(500, "the engine failed while generating this completion", type="server_error")
    if any(c.finish_reason == "abort" for c in out.outputs):
        return APIError(503, "the request was aborted by the server (shutting down?)", type="server_error")
    return None


def usage(outs: list[RequestOutput], jobs: list[Job]) -> dict:
    """Summed over the prompts of a request (echo with max_tokens 0 counts no completion tokens)."""
    completion = sum(sum(len(c.token_ids) for c in out.outputs) for out, job in zip(outs, jobs) if job.generate)
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outs)},
    }


# ---- one JSON response --------------------------------------------------------------------------
async def final_output(engine: AsyncLLM, request: Request, jobs: list[Job]) -> list[RequestOutput]:
    """The finished output of each job, or the APIError to answer (ClientDisconnected passes through)."""
    final: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async with aclosing(engine_outputs(engine, request, jobs)) as outs:
            async for job, out in outs:
                final[job.prompt_index] = out
    except ValueError as e:  # refused by the engine when added
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None
    outs = [out for out in final if out is not None]
    if len(outs) < len(jobs):
        raise APIError(503, "the engine returned no output", type="server_error")
    for out in outs:
        err = failure(out)
        if err is not None:
            raise err
    return outs


def completion_body(jobs: list[Job], outs: list[RequestOutput]) -> dict:
    chat = jobs[0].kind == "chat"
    choices = []
    for job, out in zip(jobs, outs):
        for c in out.outputs:
            if chat:
                message, reason = assistant_message(job.tools, c.text, c.finish_reason)
                choices.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": _chat_logprobs(job, c.token_ids, c.logprobs),
                        "finish_reason": reason,
                    }
                )
            else:
                choices.append(_text_choice(job, out, c))
    return {
        "id": jobs[0].request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": jobs[0].model_name,
        "choices": choices,
        "usage": usage(outs, jobs),
        "system_fingerprint": None,
    }


def _text_choice(job: Job, out: RequestOutput, c: CompletionOutput) -> dict:
    index = job.prompt_index * job.params.n + c.index
    if not job.generate:  # echo with max_tokens 0: the prompt alone
        return {
            "index": index,
            "text": job.echo,
            "logprobs": _text_logprobs(job, [], None, out, 0),
            "finish_reason": "length",
        }
    text = c.text if job.echo is None else job.echo + c.text
    return {
        "index": index,
        "text": text,
        "logprobs": _text_logprobs(job, c.token_ids, c.logprobs, out if job.echo is not None else None, 0),
        "finish_reason": c.finish_reason,
    }


def _chat_logprobs(job: Job, token_ids: list[int], logprobs) -> dict | None:
    if job.logprobs is None or job.texts is None:
        return None
    if logprobs is None or len(logprobs) < len(token_ids):
        raise APIError(500, "the engine returned no logprobs for this request", type="server_error")
    return {"content": chat_logprobs(job.texts, token_ids, logprobs, job.logprobs), "refusal": None}


def _text_logprobs(job: Job, token_ids: list[int], logprobs, echo_of: RequestOutput | None, offset: int) -> dict | None:
    """Completions logprobs of `token_ids`, after the prompt's own (echo) when `echo_of` is given."""
    if job.logprobs is None or job.texts is None:
        return None
    if echo_of is not None:
        prompt = echo_of.prompt_logprobs
        if prompt is None or len(prompt) < len(echo_of.prompt_token_ids):
            raise APIError(500, "the engine returned no prompt logprobs for this request", type="server_error")
        token_ids = [*echo_of.prompt_token_ids, *token_ids]
        logprobs = [*prompt, *(logprobs or [])]
    if len(token_ids) and (logprobs is None or len(logprobs) < len(token_ids)):
        raise APIError(500, "the engine returned no logprobs for this request", type="server_error")
    return completion_logprobs(job.texts, token_ids, logprobs or [], offset)


# ---- server-sent events -------------------------------------------------------------------------
def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(e: APIError) -> str:
    return _event(e.body())


class Chunks:
    """The chunks of one streamed completion: each choice's new text since the last chunk (with the
    logprobs of the tokens it adds), and one finish_reason per choice, after which that choice sends
    nothing more. Choices of several prompts are numbered prompt_index * n + i."""

    def __init__(self, jobs: list[Job], continuous_usage: bool):
        self.jobs, self.job, self.continuous_usage = jobs, jobs[0], continuous_usage
        self.chat = self.job.kind == "chat"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.created = int(time.time())
        total = self.job.params.n * len(jobs)
        self.sent = [0] * total  # characters of each choice sent
        self.sent_tokens = [0] * total  # tokens whose logprobs were sent
        self.offset = [0] * total  # completions logprobs: text_offset of the next token
        self.done = [False] * total
        self.echoed = [False] * total
        self.tool_streams: dict[int, ToolStream] = {}  # chat with tools: each choice's parser
        # the common chunk (new text, no logprobs, no usage) is filled into this stream's template,
        # the same bytes _event writes (tested): json.dumps of the whole dict was ~9% of the API
        # process's time at 256 streams
        head = _event(self._data([{"index": 0}]))
        self._head = head[: head.index('"choices":[{"index":') + len('"choices":[{"index":')]
        self._text_key = ',"delta":{"content":' if self.chat else ',"text":'

    def _data(self, choices: list, **extra) -> dict:
        return {
            "id": self.job.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.job.model_name,
            "choices": choices,
            **extra,
        }

    def chunk(
        self,
        index: int,
        content: str,
        finish_reason: str | None,
        *,
        role=False,
        usage_of=None,  # () -> the usage object, called only when usage goes out on every chunk
        logprobs=None,
        delta: dict | None = None,
    ) -> str:
        if logprobs is None and delta is None and not role and not (self.continuous_usage and usage_of is not None):
            return self._plain_chunk(index, content, finish_reason)
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        extra = {"usage": usage_of()} if self.continuous_usage and usage_of is not None else {}
        return _event(self._data([choice], **extra))

    def _plain_chunk(self, index: int, content: str, finish_reason: str | None) -> str:
        """chunk() of new text alone, filled into the template."""
        reason = "null" if finish_reason is None else encode_basestring(finish_reason)
        if self.chat and not content:
            body = ',"delta":{},"logprobs":null,"finish_reason":'
        elif self.chat:
            body = self._text_key + encode_basestring(content) + '},"logprobs":null,"finish_reason":'
        else:
            body = self._text_key + encode_basestring(content) + ',"logprobs":null,"finish_reason":'
        return f"{self._head}{index}{body}{reason}}}]}}\n\n"

    def opening(self) -> list[str]:
        """Chat streams open with one role chunk per choice (with continuous usage: the prompt's)."""
        if not self.chat:
            return []
        prompt = len(self.job.prompt_token_ids)
        opening_usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
        return [self.chunk(i, "", None, role=True, usage_of=lambda: opening_usage) for i in range(self.job.params.n)]

    def deltas(self, job: Job, out: RequestOutput, failed: bool) -> list[str]:
        events = []
        for c in out.outputs:
            i = job.prompt_index * job.params.n + c.index
            if self.done[i]:
                continue
            delta = c.text[self.sent[i] :] if len(c.text) >= self.sent[i] else ""
            self.sent[i] = max(self.sent[i], len(c.text))
            finished = c.finish_reason in ("stop", "length")
            if not job.generate:  # echo with max_tokens 0: the prompt alone, once its request is done
                if finished:
                    self.done[i] = True
                    logprobs = _text_logprobs(job, [], None, out, 0)
                    text = job.echo or ""
                    events.append(
                        self.chunk(i, text, "length", usage_of=lambda: usage([out], [job]), logprobs=logprobs)
                    )
                continue
            if not finished and (failed or not delta):
                continue
            if self.chat and job.tools is not None and job.tools.parser is not None:
                events += self._tool_chunks(job, out, c, i, delta, finished)
                continue
            echo_of = None
            if job.echo is not None and not self.echoed[i]:
                self.echoed[i], echo_of, delta = True, out, job.echo + delta
            logprobs = self._logprobs(job, c, i, echo_of)
            self.done[i] = finished
            reason = c.finish_reason if finished else None
            events.append(self.chunk(i, delta, reason, usage_of=lambda: usage([out], [job]), logprobs=logprobs))
        return events

    def _tool_chunks(self, job: Job, out: RequestOutput, c: CompletionOutput, i: int, text: str, finished: bool):
        """Chunks of a choice whose output may hold tool calls: content, held back where it may begin
        a call, and each call once complete (tools.py); none while everything new is held back."""
        assert job.tools is not None
        stream = self.tool_streams.setdefault(i, job.tools.stream())
        deltas = stream_deltas(stream, text, finished)
        if not deltas and not finished:
            return []
        logprobs = self._logprobs(job, c, i, None)
        self.done[i] = finished
        reason = finish_reason(c.finish_reason, stream.calls) if finished else None
        deltas = deltas or [{}]
        return [
            self.chunk(
                i,
                "",
                reason if k == len(deltas) - 1 else None,
                usage_of=(lambda: usage([out], [job])) if k == len(deltas) - 1 else None,
                logprobs=logprobs if k == 0 else None,
                delta=d,
            )
            for k, d in enumerate(deltas)
        ]

    def _logprobs(self, job: Job, c: CompletionOutput, i: int, echo_of: RequestOutput | None) -> dict | None:
        """The logprobs of the tokens choice i generated since its last chunk (after the prompt's, on
        the chunk that echoes it)."""
        if job.logprobs is None:
            return None
        start, self.sent_tokens[i] = self.sent_tokens[i], len(c.token_ids)
        ids, lps = c.token_ids[start:], c.logprobs[start:] if c.logprobs is not None else None
        if self.chat:
            return _chat_logprobs(job, ids, lps)
        body = _text_logprobs(job, ids, lps, echo_of, self.offset[i])
        if body is not None:
            self.offset[i] += sum(len(t) for t in body["tokens"])
        return body

    def usage(self, outs: list[RequestOutput]) -> str:
        return _event(self._data([], usage=usage(outs, self.jobs)))


async def sse_events(engine: AsyncLLM, request: Request, jobs: list[Job], include_usage: bool, continuous_usage: bool):
    """The event stream of one completion (of all its prompts), ending in `data: [DONE]` (after an
    error event if it failed)."""
    chunks = Chunks(jobs, continuous_usage)
    last: dict[int, RequestOutput] = {}
    try:
        for event in chunks.opening():
            yield event
        async with aclosing(engine_outputs(engine, request, jobs)) as outs:
            async for job, out in outs:
                last[job.prompt_index] = out
                err = failure(out)
                for event in chunks.deltas(job, out, failed=err is not None):
                    yield event
                if err is not None:
                    yield error_event(err)
                    yield DONE
                    return
        if include_usage and len(last) == len(jobs):
            yield chunks.usage([last[k] for k in range(len(jobs))])
        yield DONE
    except ClientDisconnected:
        return
    except APIError as e:
        yield error_event(e)
        yield DONE
    except ValueError as e:
        yield error_event(APIError(400, str(e)))
        yield DONE
    except RuntimeError as e:
        yield error_event(APIError(503, str(e), type="server_error"))
        yield DONE
