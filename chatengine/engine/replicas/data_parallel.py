"""DataParallelLLM: N engine replicas, each in its own process on its own GPUs, behind one API.

It offers what AsyncLLM offers (generate / chat / abort / stats / personas / forget), so the app
serves it the same way. Requests are validated and tokenized here (EngineFront: the tokenizer
and the model's limits, no weights), routed (router.py: to the replica that holds the
conversation's pages, else the least loaded), and streamed back as deltas that are put together
into the cumulative RequestOutputs AsyncLLM gives (each made when its caller reads it). Public
personas are registered and warmed on every replica. A replica that dies fails only its own
requests; the others serve on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import os
import secrets
import threading
from dataclasses import dataclass

import torch

from chatengine.config import EngineConfig
from chatengine.engine.facade import EngineFacade
from chatengine.engine.front import EngineFront
from chatengine.engine.kv.hashing import load_or_create_secret, salt_start_block
from chatengine.engine.loader import load_model
from chatengine.engine.model_runner import context_len, resolve_device_dtype
from chatengine.engine.output_queue import Mailbox, follow, make_request
from chatengine.engine.replicas.chains import Chain, RouterChains
from chatengine.engine.replicas.deltas import Delta, OutputAssembler
from chatengine.engine.replicas.handle import ReplicaHandle
from chatengine.engine.replicas.replica import WARM, ReplicaSpec
from chatengine.engine.replicas.router import Router

log = logging.getLogger("chatengine.replicas")
MAX_REPLICAS = 64


@dataclass
class _Running:
    """A request in flight: where it went, who waits for it, what has come back."""

    replica: int
    loop: asyncio.AbstractEventLoop
    queue: Mailbox  # an _Outputs, or an exception put in its place
    assembler: OutputAssembler
    chain: Chain | None  # the router's hash chain of the prompt (None: one replica, no routing)
    # its caller stopped listening (closed the stream): deltas that come after the mark go to no
    # loop, and its end is counted on the listener thread (a loop that closes right after would
    # drop a callback queued to it). The router then learns the prompt's blocks, not the answer's.
    abandoned: bool = False


class DataParallelLLM(EngineFacade):
    def __init__(self, model: str | None = None, *, data_parallel_size: int = 2, **kwargs):
        if not isinstance(data_parallel_size, int) or not 1 <= data_parallel_size <= MAX_REPLICAS:
            raise ValueError(
                f"data_parallel_size must be an integer in [1, {MAX_REPLICAS}], got {data_parallel_size!r}"
            )
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        device, _ = resolve_device_dtype(config.device, config.dtype)
        self.size = data_parallel_size
        specs = _placement(config, device, data_parallel_size)
        # the tokenizer and the model's shape, not its weights (they are read only when taken)
        loaded = load_model(config.model, seed=config.seed, device="cpu")
        self.front = EngineFront(
            config, loaded.config, loaded.model_id, loaded.tokenizer, context_len(config, loaded.config), 0
        )
        del loaded
        if config.data_dir:  # made once here, before the replicas race to make it: they salt alike
            load_or_create_secret(config.data_dir)
        self.chains = RouterChains(secrets.token_bytes(32), config.block_size)
        self.router = Router(data_parallel_size, capacity=config.max_num_seqs)
        self._lock = threading.Lock()  # the router and the running table: event loops and listeners
        self._running: dict[str, _Running] = {}
        self._stopped = False
        self.replicas = [ReplicaHandle(spec) for spec in specs]  # they load in parallel
        try:
            facts = [r.wait_ready() for r in self.replicas]
            self.front.num_blocks = min(f["num_blocks"] for f in facts)
            if config.register_personas and self.front.tokenizer is not None:
                from chatengine.personas import load_personas

                for persona in load_personas().values():  # the replicas registered (and warm) them too
                    self.front.register_persona(persona.name, persona.system_prompt)
        except BaseException:
            for r in self.replicas:
                r.kill()
            raise
        for r in self.replicas:
            r.listen(self._on_out, self._on_exit)
        # the replicas are no daemons (a tensor-parallel one has processes of its own): at exit
        # they stop before the interpreter waits for them
        atexit.register(self.shutdown)

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params=None, *, request_id: str | None = None, user: str | None = None):
        """As AsyncLLM.generate: cumulative RequestOutputs until finished; closing the generator
        aborts the request."""
        req = await make_request(self.front.make_request, prompt, sampling_params, request_id, user)
        if self._stopped:
            raise RuntimeError("the engine has shut down")
        if req.request_id.startswith(WARM):
            raise ValueError("request ids must not start with a NUL character")
        ids = req.prompt_token_ids
        first = salt_start_block(self.front.public_prefix_len(ids), self.front.config.block_size)
        # one replica (serve --engine-process) has no choice to make: its requests are not hashed
        # (~0.2 ms for a 2k-token conversation, and its answer's blocks at the end)
        chain = self.chains.of_prompt(ids, user, first) if self.size > 1 else None
        queue = _Outputs()
        with self._lock:
            if req.request_id in self._running:
                raise ValueError(f"request id {req.request_id!r} is already running")
            route = self.router.route(chain.hashes[first:] if chain is not None else [])
            running = _Running(
                route.replica,
                asyncio.get_running_loop(),
                queue,
                OutputAssembler(req.request_id, req.prompt, ids),
                chain,
            )
            self._running[req.request_id] = running
        message = ("add", req.request_id, req.prompt, ids, req.params, user)
        try:
            sent = self.replicas[route.replica].send(message)
        except BaseException:  # e.g. a value that does not pickle: nothing of it may stay counted
            self._finish(req.request_id)
            raise
        if not sent:
            self._finish(req.request_id)
            raise RuntimeError(f"replica {route.replica} has stopped: try again")
        async with contextlib.aclosing(follow(queue, lambda: self._abandon(running))) as outputs:
            async for item in outputs:
                yield item

    async def chat(self, messages, sampling_params=None, *, request_id=None, user=None):
        ids = self.apply_chat_template(messages)
        generation = self.generate(ids, sampling_params, request_id=request_id, user=user)
        async with contextlib.aclosing(generation) as outputs:  # closing chat aborts at once
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        running = self._running.get(request_id)
        if running is not None:
            self.replicas[running.replica].send(("abort", request_id))

    def _abandon(self, running: _Running) -> None:
        """Its caller closed the stream: marked before the abort goes out, so the final delta that
        the abort brings back finds the mark (one already on its way is checked again in _on_out)."""
        running.abandoned = True
        if self._running.get(running.assembler.request_id) is running:
            self.replicas[running.replica].send(("abort", running.assembler.request_id))

    # ---- what comes back (listener threads) -----------------------------------------------------
    def _on_out(self, replica: int, deltas: list[Delta], refused: list[tuple[str, str]]) -> None:
        """A step's deltas, handed to each caller's event loop in one batch: there each is applied to
        its request's assembler (touched on that loop only: no lock between a delta and a read) and
        the assembler put in the caller's mailbox, which makes the RequestOutput when the caller
        reads it (a caller behind by several steps gets the newest; the ones skipped are never made).
        An abandoned request's deltas go nowhere; its end is counted here."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            running = self._running.get(delta[0])
            if running is not None and running.abandoned:
                if delta[1]:  # finished: nobody reads it, and its caller's loop may be closing
                    self._finish(delta[0], expected=running)
            elif running is not None:
                batches.setdefault(running.loop, []).append((running, delta))
        for request_id, message in refused:
            running = self._finish(request_id)
            if running is not None:
                batches.setdefault(running.loop, []).append((running, ValueError(message)))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the caller's loop has closed: nobody is listening any more
                for running, item in batch:
                    if not isinstance(item, tuple):
                        continue
                    if item[1]:  # finished: counted done
                        self._finish(item[0], expected=running)
                    else:
                        self.replicas[replica].send(("abort", item[0]))
                continue
            for running, item in batch:  # abandoned meanwhile: a loop about to close may drop the
                if isinstance(item, tuple) and item[1] and running.abandoned:  # callback, so counted
                    self._finish(item[0], expected=running)  # here (else it was queued first: it runs)

    def _deliver(self, batch: list) -> None:
        """On a caller's event loop: (request, delta or exception) in a step's order."""
        for running, item in batch:
            if not isinstance(item, BaseException):
                try:
                    if running.assembler.add(item):
                        self._finish(item[0], running.assembler, expected=running)
                    item = running.assembler
                except Exception as e:  # a bug here fails this request, never the batch's others
                    log.exception("request %r: its output could not be put together", item[0])
                    self._finish(item[0], expected=running)
                    item = RuntimeError(f"its output could not be put together: {e}")
            running.queue.put_nowait(item)

    def _finish(
        self, request_id: str, done: OutputAssembler | None = None, expected: _Running | None = None
    ) -> _Running | None:
        """The request is done: its replica now holds its prompt and answer (the router learns so).
        With `expected`, only that request (not a later one given the same id meanwhile)."""
        with self._lock:
            running = self._running.get(request_id)
            if running is None or (expected is not None and running is not expected):
                return None
            del self._running[request_id]
        held: list[bytes] = []  # hashed outside the lock, which the event loops' new requests need
        if done is not None and running.chain is not None:  # the answer's blocks
            held = self.chains.of_answer(running.chain, done.prompt_token_ids + done.token_ids(0))
        with self._lock:
            self.router.finished(running.replica, held)
        return running

    def _on_exit(self, replica: int, reason: str) -> None:
        """A replica has gone: the router stops sending to it; the requests it still had fail. After
        a clean stop it aborted them and their final outputs came first: queued on their callers'
        loops ahead of this error, which a finished output's mailbox then ignores."""
        with self._lock:
            self.router.mark_dead(replica)
            lost = [(rid, r) for rid, r in self._running.items() if r.replica == replica]
        for request_id, expected in lost:
            running = self._finish(request_id, expected=expected)
            if running is None:
                continue
            error = RuntimeError(reason or f"replica {replica} stopped")
            try:
                running.loop.call_soon_threadsafe(running.queue.put_nowait, error)
            except RuntimeError:  # that caller's loop has closed: nobody is listening
                pass

    # ---- the rest of AsyncLLM's surface ---------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """True while the engine accepts requests (at least one replica lives)."""
        return not self._stopped and any(r.alive for r in self.replicas)

    def stats(self) -> dict:
        """Every replica's figures summed (their last snapshots), each replica's own, the router's."""
        each = [dict(r.stats) for r in self.replicas]
        total = _sum_stats([s for s in each if s])
        with self._lock:
            total["router"] = {**self.router.counts, "load": list(self.router.load)}
        total["replicas"] = each
        total["data_parallel_size"] = self.size
        return total

    def register_persona(self, name: str, system_prompt: str) -> None:
        """Share the persona's pages across users, on every replica (each computes them now)."""
        self.front.register_persona(name, system_prompt)
        self._broadcast(("persona", name, system_prompt))

    def unregister_persona(self, name: str) -> None:
        if self.front.unregister_persona(name) is not None:
            self._broadcast(("unpersona", name))

    def forget_user(self, user: str) -> None:
        self.front.check_forget(user)  # here: in a replica a ValueError reaches no caller
        self.chains.forget(user)  # the router's copies of the user's token ids go too
        self._broadcast(("forget", user))

    def forget_prompts(self, user: str, prompts: list[list[int]]) -> None:
        prompts = self.front.check_forget_prompts(user, prompts)
        self.chains.forget(user)
        self._broadcast(("forget_prompts", user, prompts))

    def _broadcast(self, message: tuple) -> None:
        for r in self.replicas:
            r.send(message)

    def shutdown(self) -> None:
        """Abort what runs; each replica flushes its KV store and exits."""
        if self._stopped:
            return
        self._stopped = True
        for r in self.replicas:
            r.send(("stop",))
        for r in self.replicas:
            r.stop()


def _placement(config: EngineConfig, device: torch.device, size: int) -> list[ReplicaSpec]:
    """Each replica's settings: its own GPUs (tensor_parallel_size of them) or its share of the cores,
    and its own directory of the disk tier (replicas never write each other's files)."""
    tp = config.tensor_parallel_size
    specs = []
    log_level = logging.getLogger().getEffectiveLevel()  # the replicas log as this process does
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g] if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < size * tp:
            raise ValueError(
                f"data_parallel_size={size} x tensor_parallel_size={tp} needs {size * tp} GPUs; this machine "
                f"shows {len(gpus)}"
            )
    for i in range(size):
        replica_config = dataclasses.replace(config, device=device.type)
        if config.kv_store_dir and size > 1:
            replica_config = dataclasses.replace(
                replica_config, kv_store_dir=os.path.join(config.kv_store_dir, f"replica{i}")
            )
        if device.type == "cuda":
            gpus_of_replica = tuple(gpus[i * tp : (i + 1) * tp])
            specs.append(
                ReplicaSpec(i, replica_config, cuda_devices=gpus_of_replica, log_level=log_level, replicas=size)
            )
        else:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = max(1, cores // size) if size > 1 else None  # one replica: torch's own default
            specs.append(ReplicaSpec(i, replica_config, num_threads=threads, log_level=log_level, replicas=size))
    return specs


def _sum_stats(each: list[dict]) -> dict:
    """Numbers summed, settings (strings, block size, context) from the first replica, the hit rate
    recomputed from the summed counts."""
    if not each:
        return {}
    total = dict(each[0])
    for key, value in each[0].items():
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and key not in ("block_size", "max_model_len", "stream_interval")
        ):
            total[key] = sum(s.get(key, 0) for s in each)
    queried = total.get("prefix_cache_queried_tokens", 0)
    total["prefix_cache_hit_rate"] = total.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
    total["stream_interval"] = max(s.get("stream_interval", 1) for s in each)  # the longest chunks in force
    return total


class _Outputs(Mailbox):
    """A request's mailbox: holds its assembler (or an exception), and makes the newest output of
    it when the caller takes one."""

    def __init__(self):
        super().__init__()
        self._read = 0  # deltas in the last output taken

    async def get(self):
        while True:
            item = await super().get()
            if not isinstance(item, OutputAssembler):
                return item
            out, count = item.output_and_count()
            if count > self._read:  # else an earlier hand-over's output held it all already
                self._read = count
                return out
