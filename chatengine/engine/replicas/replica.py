"""A data-parallel replica's process: one LLMEngine (itself possibly tensor parallel) on its own
GPUs (or its share of the CPU cores), run by an EngineLoop that takes requests from a pipe to the
API process and sends back what each step added (deltas.py).

The pipe carries, API process -> replica:
  ("add", request_id, prompt text or None, prompt ids, SamplingParams, user)
  ("abort", request_id) ("forget", user) ("forget_prompts", user, prompts)
  ("persona", name, system_prompt) ("unpersona", name) ("stop",)
and replica -> API process:
  ("ready", facts) ("out", [Delta], [(request_id, refusal message)]) ("stats", dict)
  ("stopped",) ("error", traceback text)
End of file on the pipe, or a send that finds it broken (the API process is gone), stops the
replica as ("stop",) does: what runs is aborted and the KV store flushed. Signals are the API
process's to handle: a Ctrl-C or a SIGTERM to the process group leaves the replicas to be stopped
through their pipes, after the API process has drained its streams.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from chatengine.config import EngineConfig
from chatengine.engine.engine_loop import Delivery, EngineLoop
from chatengine.engine.llm_engine import LLMEngine
from chatengine.engine.replicas.deltas import DeltaEncoder
from chatengine.sampling_params import SamplingParams

WARM = "\x00warm:"  # request ids of persona warm-ups: never sent to the API process
STATS_EVERY_S = 0.2
# streams the one API process relays a token at a time, over all its replicas; beyond, each stream's
# chunks grow with the running streams, up to MAX_CHUNK_STEPS steps: its Python work per delta is
# ~25 us (front_bench, 512 users on 2 shared cores: ~40k tok/s relayed at 2 tokens a chunk, ~60k at 4)
RELAYED_STREAMS = 128
MAX_CHUNK_STEPS = 4


@dataclass(frozen=True)
class ReplicaSpec:
    index: int
    config: EngineConfig
    cuda_devices: tuple[str, ...] | None = None  # the GPUs this replica sees (CUDA_VISIBLE_DEVICES entries)
    num_threads: int | None = None  # CPU: torch threads (the replicas split the cores)
    log_level: int = logging.WARNING  # the API process's
    replicas: int = 1  # how many share the API process


def relay_interval(replicas: int) -> Callable[[int], int]:
    """Steps between a stream's outputs at n running sequences of this replica (stream_interval
    None): 1 while all the replicas together run about RELAYED_STREAMS, then growing with them."""

    def interval(n: int) -> int:
        return min(MAX_CHUNK_STEPS, max(1, -(-n * replicas // RELAYED_STREAMS)))

    return interval


def main(spec: ReplicaSpec, conn: Connection) -> None:
    """The replica process (spawned by the API process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s %(levelname)s replica{spec.index} %(name)s: %(message)s"
    )
    try:
        engine = start_engine(spec)
    except BaseException:
        _send_error(conn)
        os._exit(1)
    loop = ReplicaLoop(engine, conn)
    try:
        # the process is the engine's alone: what start-up built (the model, torch, the tokenizer)
        # leaves the cyclic collector's sight, as the API process does, so a full collection walks
        # only what serving makes instead of stalling every stream for hundreds of milliseconds
        gc.collect()
        gc.freeze()
        facts = {"num_blocks": engine.block_manager.num_blocks, "model_id": engine.model_id, "stats": engine.stats()}
        loop.send(("ready", facts))
        for ids in engine.personas.values():
            loop.warm(ids)
        threading.Thread(target=loop.read, name="chatengine-replica-pipe", daemon=True).start()
        loop.run()
        loop._compiler.shutdown(wait=False, cancel_futures=True)
        engine.close()
        loop.send(("stopped",))
    except BaseException:
        _send_error(conn)
        os._exit(1)


def start_engine(spec: ReplicaSpec) -> LLMEngine:
    """The replica's engine on its GPUs (or its share of the cores), its streams chunked for the
    API process that relays them."""
    if spec.cuda_devices is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.cuda_devices))
    import torch

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    engine = LLMEngine(spec.config)
    engine.relay_interval = relay_interval(spec.replicas)
    return engine


def _send_error(conn: Connection) -> None:
    try:
        conn.send(("error", traceback.format_exc(limit=-8)))
    except OSError:
        pass


class ReplicaLoop(EngineLoop):
    def __init__(self, engine: LLMEngine, conn: Connection):
        super().__init__(engine)
        self.conn = conn
        self._send_lock = threading.Lock()  # the pipe reader and the compilers refuse bad requests
        self._encoder = DeltaEncoder()
        self._stats_time = 0.0
        self._orphaned = False
        # structured-output requests compile their grammar here, off the pipe reader: a long
        # compile never holds up another user's request, abort or persona behind it
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="chatengine-grammar")
        self._compiling: dict[str, bool] = {}  # request id -> aborted while its grammar compiles
        self._compiling_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        """To the API process; once it is gone, nothing more is sent and the loop stops."""
        if self._orphaned:
            return
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:  # the API process is gone (SIGKILLed?): stop, flushing the KV store
            self._orphaned = True
            self.post(("stop",))

    def read(self) -> None:
        """The pipe reader: adds are validated here (or on a compiler thread), then posted."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the API process is gone: stop (the KV store is flushed)
                self.post(("stop",))
                return
            kind = message[0]
            if kind == "add" and message[4].structured_outputs is not None:
                with self._compiling_lock:
                    self._compiling[message[1]] = False
                self._compiler.submit(self._add, *message[1:])
            elif kind == "add":
                self._add(*message[1:])
            elif kind == "abort" and self._abort_compiling(message[1]):
                continue
            else:
                self.post(message)
                if kind == "stop":
                    return

    def _abort_compiling(self, request_id: str) -> bool:
        """An abort of a request still compiling is applied once it is added."""
        with self._compiling_lock:
            if request_id in self._compiling:
                self._compiling[request_id] = True
                return True
        return False

    def _add(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams, user) -> None:
        try:
            req = self.engine.make_request(ids, params, request_id=request_id, user=user)
        except ValueError as e:  # the API process checked it already; a replica with less room may not fit it
            req = None
            self.send(("out", [], [(request_id, str(e))]))
        with self._compiling_lock:
            aborted = self._compiling.pop(request_id, False)
        if req is None:
            return
        req.prompt = text
        self.post(("add", req, None))
        if aborted:
            self.post(("abort", request_id))

    def warm(self, prefix_ids: list[int]) -> None:
        """Compute a public persona's pages now, so its first conversation here hits them. On the
        loop's thread, straight into the engine: ahead of requests that arrived after it."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        try:
            req = self.engine.make_request(prefix_ids, params, request_id=WARM + uuid.uuid4().hex)
        except ValueError:  # a prefix that does not fit the context: nothing to warm
            return
        req.stream = False  # nobody reads it
        self.engine.add(req)

    def _handle(self, item: tuple) -> None:
        if item[0] == "persona":
            self.engine.register_persona(item[1], item[2])
            self.warm(self.engine.personas[item[1]])
        elif item[0] == "unpersona":
            ids = self.engine.unregister_persona(item[1])
            if ids is not None:
                self.engine.drop_public_prefix(ids)
        else:
            super()._handle(item)

    def _deliver_many(self, items: Delivery) -> None:
        deltas, refused = [], []
        for request_id, out in items:
            if request_id.startswith(WARM):
                continue
            if isinstance(out, Exception):
                refused.append((request_id, str(out)))
            else:
                deltas.append(self._encoder.encode(out))
        if deltas or refused:
            self.send(("out", deltas, refused))

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_EVERY_S:
            self._stats_time = now
            self.send(("stats", self.engine.stats()))
