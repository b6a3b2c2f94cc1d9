"""Relaying one engine request to an HTTP client: its outputs, cut short when the client goes away,
and the response bodies built from them (one JSON object, or server-sent events).

A client that disconnects (streaming or not) has its engine request aborted at once, which frees its
KV blocks: a watcher task waits for the ASGI `http.disconnect` message. A streamed error after the
headers went out is sent as `data: {"error": ...}` followed by `data: [DONE]`.
"""

import asyncio
import json
import logging
import time
from contextlib import aclosing, suppress
from dataclasses import dataclass

from starlette.requests import Request

from chatengine import AsyncLLM, RequestOutput, SamplingParams
from chatengine.app.api.protocol import APIError, Kind

log = logging.getLogger("chatengine.api")

DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True)
class Job:
    """A validated, tokenized request on its way to the engine."""

    kind: Kind
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    user: str | None
    model_name: str


# ---- engine outputs -----------------------------------------------------------------------------
async def watch_disconnect(engine: AsyncLLM, request: Request, request_id: str) -> None:
    """Wait for the client to go away, then abort its engine request at once (frees its blocks
    even while nobody is iterating the outputs, e.g. a stream blocked in a send)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            await engine.abort(request_id)
            return
        await asyncio.sleep(0.05)


async def engine_outputs(engine: AsyncLLM, request: Request, job: Job):
    """The engine's outputs until finished. ClientDisconnected when the client goes away, 503 when the
    engine stops; any early exit aborts the engine request (AsyncLLM frees its blocks)."""
    agen = engine.generate(job.prompt_token_ids, job.params, request_id=job.request_id, user=job.user)
    watcher = asyncio.ensure_future(watch_disconnect(engine, request, job.request_id))
    pending = None
    finished = False
    try:
        while not finished:
            pending = asyncio.ensure_future(agen.__anext__())
            await _wait_for(engine, pending, watcher)
            task, pending = pending, None
            try:
                out = task.result()
            except StopAsyncIteration:
                return
            finished = out.finished
            yield out
    finally:
        # synchronous first: under cancellation every await below may raise at once
        watcher.cancel()
        if pending is not None:
            pending.cancel()
        if not finished:
            await engine.abort(job.request_id)  # posts to the engine thread; does not suspend
        if pending is not None:
            await _quietly(pending)
        await _quietly(agen.aclose())


async def _quietly(awaitable) -> None:
    """Await for its side effect only: it was cancelled, or the request is over and its end moot."""
    with suppress(BaseException):
        await awaitable


async def _wait_for(engine: AsyncLLM, pending: asyncio.Future, watcher: asyncio.Future) -> None:
    """Until `pending` is done; checks every second that the engine still runs."""
    while True:
        done, _ = await asyncio.wait({pending, watcher}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        if pending in done:
            return
        if watcher in done:
            raise ClientDisconnected()
        if not engine.is_running:
            raise APIError(503, "the engine has stopped", type="server_error")


def failure(out: RequestOutput) -> APIError | None:
    """The error to report for a finished output: 500 when the engine failed, 503 when it aborted."""
    if out.error:
        log.error("engine failed request %s: %s", out.request_id, out.error)
        return APIError(500, "the engine failed while generating this completion", type="server_error")
    if any(c.finish_reason == "abort" for c in out.outputs):
        return APIError(503, "the request was aborted by the server (shutting down?)", type="server_error")
    return None


def usage(out: RequestOutput) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


# ---- one JSON response --------------------------------------------------------------------------
async def final_output(engine: AsyncLLM, request: Request, job: Job) -> RequestOutput:
    """The finished output, or the APIError to answer (ClientDisconnected passes through)."""
    final = None
    try:
        async with aclosing(engine_outputs(engine, request, job)) as outs:
            async for out in outs:
                final = out
    except ValueError as e:  # refused by the engine when added
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None
    if final is None:
        raise APIError(503, "the engine returned no output", type="server_error")
    err = failure(final)
    if err is not None:
        raise err
    return final


def completion_body(job: Job, out: RequestOutput) -> dict:
    if job.kind == "chat":
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for c in out.outputs
        ]
        obj = "chat.completion"
    else:
        choices = [
            {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason} for c in out.outputs
        ]
        obj = "text_completion"
    return {
        "id": job.request_id,
        "object": obj,
        "created": int(time.time()),
        "model": job.model_name,
        "choices": choices,
        "usage": usage(out),
        "system_fingerprint": None,
    }


# ---- server-sent events -------------------------------------------------------------------------
def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(e: APIError) -> str:
    return _event(e.body())


class Chunks:
    """The chunks of one streamed completion: each choice's new text since the last chunk, and one
    finish_reason per choice, after which that choice sends nothing more."""

    def __init__(self, job: Job, continuous_usage: bool):
        self.job, self.continuous_usage = job, continuous_usage
        self.chat = job.kind == "chat"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.created = int(time.time())
        self.sent = [0] * job.params.n
        self.done = [False] * job.params.n

    def _data(self, choices: list, **extra) -> dict:
        return {
            "id": self.job.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.job.model_name,
            "choices": choices,
            **extra,
        }

    def chunk(self, index: int, content: str, finish_reason: str | None, *, role=False, out=None) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": None, "finish_reason": finish_reason}
        extra = {"usage": usage(out)} if self.continuous_usage and out is not None else {}
        return _event(self._data([choice], **extra))

    def opening(self) -> list[str]:
        """Chat streams open with one role chunk per choice."""
        return [self.chunk(i, "", None, role=True) for i in range(self.job.params.n)] if self.chat else []

    def deltas(self, out: RequestOutput, failed: bool) -> list[str]:
        events = []
        for c in out.outputs:
            i = c.index
            if self.done[i]:
                continue
            delta = c.text[self.sent[i] :] if len(c.text) >= self.sent[i] else ""
            self.sent[i] = max(self.sent[i], len(c.text))
            if c.finish_reason in ("stop", "length"):
                self.done[i] = True
                events.append(self.chunk(i, delta, c.finish_reason, out=out))
            elif delta and not failed:
                events.append(self.chunk(i, delta, None, out=out))
        return events

    def usage(self, out: RequestOutput) -> str:
        return _event(self._data([], usage=usage(out)))


async def sse_events(engine: AsyncLLM, request: Request, job: Job, include_usage: bool, continuous_usage: bool):
    """The event stream of one completion, ending in `data: [DONE]` (after an error event if it failed)."""
    chunks = Chunks(job, continuous_usage)
    last = None
    try:
        for event in chunks.opening():
            yield event
        async with aclosing(engine_outputs(engine, request, job)) as outs:
            async for out in outs:
                last = out
                err = failure(out)
                for event in chunks.deltas(out, failed=err is not None):
                    yield event
                if err is not None:
                    yield error_event(err)
                    yield DONE
                    return
        if include_usage and last is not None:
            yield chunks.usage(last)
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
