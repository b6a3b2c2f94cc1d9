"""LLMEngine: requests in, step() out; the scheduler, the model runner and the KV tiers meet here.

One step: schedule -> launch the model -> advance the sequences (stop checks, detokenize) -> outputs.

Async scheduling (on by default on CUDA): step() schedules and launches step N+1 before it processes
step N's sampled tokens, so the host's work for N (stop checks, detokenizing, outputs, publishing)
and for scheduling N+1 runs while the GPU computes N+1 instead of between the two. N+1 is
scheduled on placeholders for N's tokens (their ids stay on the device); a sequence that one of
them stops (EOS, a stop string) is found one step later, at the cost of one wasted lane.
"""

import logging
import secrets
import time
from collections.abc import Callable

from chatengine.config import EngineConfig
from chatengine.engine import structured
from chatengine.engine.front import EngineFront
from chatengine.engine.kv.block_manager import BlockManager, owner_tag
from chatengine.engine.kv.disk_store import drop_owner_files
from chatengine.engine.kv.hashing import (
    hash_blocks,
    load_or_create_secret,
    model_fingerprint,
    salt_start_block,
    user_salt,
)
from chatengine.engine.kv.tiers import TieredCache
from chatengine.engine.kv.transfers import KVTransfers
from chatengine.engine.loader import load_model
from chatengine.engine.model_runner import ModelRunner, context_len, resolve_device_dtype
from chatengine.engine.models.parallel_layers import check_split
from chatengine.engine.parallel.ranks import WorkerRanks
from chatengine.engine.request import Request
from chatengine.engine.sampler import seed_key
from chatengine.engine.scheduler import Scheduler
from chatengine.engine.sequence import Sequence
from chatengine.engine.tokenizer import IncrementalDetokenizer
from chatengine.outputs import CompletionOutput, RequestOutput, TokenLogprobs

log = logging.getLogger("chatengine")
KV_LAYOUT = "page-first/v1"


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device, dtype = resolve_device_dtype(config.device, config.dtype)
        loaded = load_model(config.model, seed=config.seed, dtype=dtype, device=str(device))
        mc = self.model_config = loaded.config
        self.model_id, self.tokenizer = loaded.model_id, loaded.tokenizer
        self.max_model_len = context_len(config, mc)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context ({mc.max_position_embeddings})"
            )
        # tensor parallelism: ranks 1..N-1 in their own processes, this one rank 0
        self.ranks: WorkerRanks | None = None
        if config.tensor_parallel_size > 1:
            check_split(mc, config.tensor_parallel_size)  # before any process starts
            self.ranks = WorkerRanks(config, device)
        try:
            group, plan = (self.ranks.group, self.ranks.plan) if self.ranks is not None else (None, None)
            self.runner = ModelRunner(config, loaded, device, dtype, self.max_model_len, group, plan)
        except BaseException:
            self._stop_ranks()
            raise
        self.weights_digest, self.hf_dir = loaded.weights_digest, loaded.hf_dir
        del loaded
        # the root of every block-hash chain: other weights, dtype or layout can never hit these blocks
        quantization = self.runner.quantization
        numerics = str(dtype) + (f"+{quantization}" if quantization != "none" else "")
        root = model_fingerprint(self.model_id, self.weights_digest, numerics, KV_LAYOUT, config.block_size)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching, root)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        # whoever relays this engine's streams (a replica's API process) may ask for longer chunks
        # as more run: running sequences -> steps between a stream's outputs (stream_interval None)
        self.relay_interval: Callable[[int], int] | None = None
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
        )
        # with async scheduling a grammar row waits for its next mask (filled on a worker meanwhile)
        # beside plain rows; run step by step, the schedule does not depend on a fill's timing
        self.scheduler.wait_for_masks = self.async_scheduling
        self._in_flight: tuple | None = None  # (SchedulerOutput, LaunchedStep) not collected yet
        self.tiers = self._make_tiers(root)
        self.block_manager.tiers = self.tiers
        self.transfers = KVTransfers(self.runner, self.block_manager, self.tiers) if self.tiers is not None else None
        self.block_manager.write_behind = config.kv_store_dir is not None and config.enable_prefix_caching
        # per-user salts derive from this secret; kept on disk so salted blocks outlive restarts
        secret_dir = config.data_dir or config.kv_store_dir
        self.secret = load_or_create_secret(secret_dir) if secret_dir else secrets.token_bytes(32)
        self.eos_token_ids = set(mc.eos_token_ids)
        self.requests: dict[str, Request] = {}
        # validation, tokenizing, grammars and personas: what admits a request (safe from any thread)
        self.front = EngineFront(config, mc, self.model_id, self.tokenizer, self.max_model_len, self.runner.num_blocks)
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.num_forks = 0
        if config.register_personas and self.tokenizer is not None:
            from chatengine.personas import load_personas

            for persona in load_personas().values():
                self.register_persona(persona.name, persona.system_prompt)

    def _make_tiers(self, root: bytes) -> TieredCache | None:
        config, runner = self.config, self.runner
        if not config.enable_prefix_caching or (config.cpu_offload_gib == 0 and not config.kv_store_dir):
            return None
        num_host = int(config.cpu_offload_gib * 2**30) // runner.block_bytes
        if config.kv_store_dir:  # restores go through host memory: room for at least one whole context
            num_host = max(num_host, self.block_manager.num_blocks_for(self.max_model_len) + 1)
        runner.share_host_pool(num_host)  # tensor parallelism: each rank a pool of its slices, same slots
        return TieredCache(
            root,
            runner.kv_cache.shape[1:],
            runner.dtype,
            num_host,
            runner.device.type == "cuda",
            config.kv_store_dir,
            int(config.kv_store_gib * 2**30),
        )

    def flush_kv(self) -> None:
        """Write every cached block of every tier to the disk store and wait for it."""
        if self.transfers is not None:
            self.transfers.flush()

    def offload_cached_blocks(self, max_blocks: int | None = None, idle_for_s: float = 0.0) -> int:
        """Move idle cached pages (free on the device for at least idle_for_s, oldest first) to host
        memory now, freeing the device for active users. Blocks of running requests never move.
        Returns how many moved."""
        return self.transfers.offload_idle(max_blocks, idle_for_s) if self.transfers is not None else 0

    def forget_user(self, user: str) -> int:
        """Drop a (deleted) user's cached KV from every tier; returns the number of blocks dropped."""
        self.front.check_forget(user)
        owner = owner_tag(user_salt(self.secret, user))
        n = self.block_manager.drop_owner(owner)
        return n + (self.tiers.drop_owner(owner) if self.tiers is not None else 0)

    def forget_prompts(self, user: str, prompts: list[list[int]]) -> int:
        """Drop the user's private KV blocks of these token sequences (a deleted conversation's
        branches) from every tier; the public persona blocks they start with stay. Blocks that a
        running request uses stay too. Returns the number of blocks dropped."""
        prompts = self.front.check_forget_prompts(user, prompts)
        salt, bs, hashes = user_salt(self.secret, user), self.config.block_size, set()
        for ids in prompts:
            first = salt_start_block(self.public_prefix_len(ids), bs)
            hashes.update(hash_blocks(self.block_manager.root, ids, bs, first, salt)[first:])
        n = self.block_manager.drop_hashes(hashes)
        return n + (self.tiers.drop_hashes(hashes) if self.tiers is not None else 0)

    @staticmethod
    def forget_user_on_disk(kv_store_dir: str, data_dir: str, user: str) -> int:
        """Delete a user's KV block files under every model root of a disk store, for a server that
        is not running (the CLI's delete-user). Returns how many files went."""
        owner = owner_tag(user_salt(load_or_create_secret(data_dir), user))
        return drop_owner_files(kv_store_dir, owner)

    def close(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = None
        times = [time.perf_counter()]
        self.flush_kv()
        times.append(time.perf_counter())
        if self.tiers is not None:
            self.tiers.close()
        times.append(time.perf_counter())
        if self.ranks is None and getattr(self, "runner", None) is not None:
            self.runner.close()
        self._stop_ranks()  # closes rank 0's runner unless a rank failed (its synchronize could hang)
        times.append(time.perf_counter())
        if times[-1] - times[0] > 5:  # a slow shutdown says where its time went
            flush, tiers, runner = (b - a for a, b in zip(times, times[1:]))
            log.info(
                "engine closed in %.1f s: KV flush %.1f s, tiers %.1f s, runner %.1f s",
                times[-1] - times[0],
                flush,
                tiers,
                runner,
            )

    def _stop_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.stop(getattr(self, "runner", None))
            self.ranks = None

    # ---- personas (kept by the front: see EngineFront) --------------------------------------------
    @property
    def personas(self) -> dict[str, list[int]]:
        return self.front.personas

    def persona_prefix_ids(self, system_prompt: str) -> list[int]:
        return self.front.persona_prefix_ids(system_prompt)

    def register_persona(self, name: str, system_prompt: str) -> None:
        """Make conversations that open with this system prompt share its KV pages across users."""
        self.front.register_persona(name, system_prompt)

    def unregister_persona(self, name: str) -> list[int] | None:
        """Stop sharing this persona's prefix; returns its prefix ids (None: no such persona), whose
        pages drop_public_prefix unpublishes. Safe from any thread."""
        return self.front.unregister_persona(name)

    def drop_public_prefix(self, prefix_ids: list[int]) -> int:
        """Unpublish the unsalted KV pages of a prefix that is no longer public, from every tier,
        except pages that a still-registered persona shares (the same leading blocks). Only
        requests that claim a registered public prefix (or user=None ones) hash blocks unsalted,
        so pages left behind (in use by a running request now) can no longer be matched by any
        other user either. Engine thread only. Returns the number of blocks dropped."""
        root, bs = self.block_manager.root, self.config.block_size
        hashes = set(hash_blocks(root, prefix_ids, bs))  # its full blocks: all public, all unsalted
        for ids in self.personas.values():
            hashes.difference_update(hash_blocks(root, ids, bs))
        if not hashes:
            return 0
        n = self.block_manager.drop_hashes(hashes)
        return n + (self.tiers.drop_hashes(hashes) if self.tiers is not None else 0)

    def public_prefix_len(self, prompt_ids: list[int]) -> int:
        return self.front.public_prefix_len(prompt_ids)

    # ---- requests -------------------------------------------------------------------------------
    def make_request(self, prompt, params=None, *, request_id=None, user=None) -> Request:
        """Validate and tokenize without touching engine state (safe from any thread)."""
        return self.front.make_request(prompt, params, request_id=request_id, user=user)

    def grammars(self):
        return self.front.grammars()

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        # n > 1: only sample 0 prefills; the others fork from it once the prompt is in the cache
        self.scheduler.add(self._new_seq(req))
        self.requests[req.request_id] = req

    def _new_seq(self, req: Request) -> Sequence:
        i = len(req.seqs)
        seq = Sequence(req.prompt_token_ids, req.params, req.request_id, i, self.config.block_size)
        if req.user is not None:  # single-tenant (user=None) shares everything
            seq.salt = user_salt(self.secret, req.user)
            seq.public_prefix_len = self.public_prefix_len(req.prompt_token_ids)
        if req.params.seed is not None:
            seq.generator = self.runner.make_generator(req.params.seed, i)
            seq.seed_key = seed_key(req.params.seed, i)
        if req.grammar is not None:
            seq.grammar = self.grammars().matcher(req.grammar)
            structured.fill_ahead([seq.grammar])  # its first mask, made while its prompt is computed
        req.seqs.append(seq)
        req.detoks.append(IncrementalDetokenizer(self.tokenizer))
        return seq

    def _fork(self, req: Request, parent: Sequence) -> None:
        """Samples 1..n-1 of a request: share the parent's prompt blocks, copy its partial tail, and
        recompute only the last prompt token (to draw their own first token from their own RNG)."""
        num_tokens = req.num_prompt_tokens - 1
        self.scheduler.forked(parent)  # its kept places: taken by the samples now
        copies, queued = [], []
        while len(req.seqs) < req.params.n:
            child = self._new_seq(req)
            if parent.num_computed_tokens < num_tokens:  # preempted meanwhile: prefill from the cache
                queued.append(child)
                continue
            try:
                copy = self.block_manager.fork(parent, child, num_tokens)
            except MemoryError:  # no room now: it queues and finds the prompt in the prefix cache
                queued.append(child)
                continue
            if copy is not None:
                copies.append(copy)
            self.scheduler.add_running(child)
            self.num_forks += 1
        for child in reversed(queued):  # ahead of the user's later requests: theirs was admitted first
            self.scheduler.add(child, first=True)
        if copies:
            if self.transfers is not None:  # a tail may land on a block evicted just now: save its page first
                self.transfers.copy_evictions()
            self.runner.copy_blocks(copies)

    def add_request(self, prompt, params=None, *, request_id=None, user=None) -> str:
        req = self.make_request(prompt, params, request_id=request_id, user=user)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(req, seq, "abort")
        return self._output(req, final=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; then process the step launched before it (async scheduling)
        or this one. Returns the outputs of the requests that the processed step advanced."""
        if self.async_scheduling and structured.fills_in_flight():
            time.sleep(0)  # lets a grammar fill that is done report now, so its row joins this step
        out = self.scheduler.schedule()
        launched = None
        outputs: list[RequestOutput] = self._flush_held(out.preempted) if out.preempted else []
        received: list = []  # (out, launched, sampled) of the step in flight, once its tokens are in
        if not out.seqs and self._in_flight is None and self.tiers is not None:
            self.tiers.wait_for_loads(0.05)  # only prefixes on their way from disk: no busy loop
        if out.seqs:
            # a row whose sampling reads its tokens on the host, scheduled on a token still in flight
            # (the scheduler does so only when every running row is such a row)
            reads_pending = any(seq.num_pending and seq.params.needs_history for seq in out.seqs)
            between = (
                self._collect_between(out, received, outputs) if reads_pending and self._in_flight is not None else None
            )
            try:
                if self.transfers is not None:
                    self.transfers.before_forward()
                launched = (out, self.runner.launch(out.seqs, out.num_new_tokens, between))
            except Exception as e:  # fail this step's requests cleanly; the engine serves the others
                log.exception("forward pass failed")
                failed = {seq.request_id for seq in out.seqs if seq.request_id in self.requests}
                outputs += self._fail(failed, f"{type(e).__name__}: {e}")
            else:
                if between is None:
                    self.scheduler.launched(out)
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._receive(previous[0], previous[1], received, outputs)
        for previous_out, previous_launched, sampled in received:
            outputs += self._advance(previous_out, previous_launched, sampled)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                before = len(received)
                self._receive(launched[0], launched[1], received, outputs)
                if len(received) > before:  # (a failed forward's outputs are in already)
                    outputs += self._advance(*received.pop())
        if self.config.debug_checks:
            self.check_invariants()
        return outputs

    def _collect_between(self, out, received: list, outputs: list[RequestOutput]):
        """Penalties, grammars and min_tokens read every token so far on the host: the tokens of the
        step in flight are received (placeholders filled, grammars advanced) after this step's
        forward is queued and before its sampling; the rest of that step's work (stop checks,
        detokenizing, outputs) waits until this step's sampling is queued too, so the device never
        waits for it."""

        def collect() -> None:
            previous, self._in_flight = self._in_flight, None
            assert previous is not None
            self.scheduler.launched(out)  # as without it: this step's placeholders, then the last step's tokens
            self._receive(previous[0], previous[1], received, outputs)

        return collect

    def _receive(self, out, launched, received: list, outputs: list[RequestOutput]) -> None:
        """A launched step's tokens are back: fill its placeholders, publish the blocks that became
        full and feed the grammars, which the next sampling reads. Appends (out, launched, sampled)
        to `received`, or a failed forward's outputs to `outputs`. Sequences finished meanwhile (a
        stop found late, an abort) are skipped: their lanes were wasted."""
        try:
            token_ids = self.runner.collect(launched)
        except Exception as e:
            log.exception("forward pass failed")
            failed = {seq.request_id for seq in out.seqs if not seq.is_finished}
            outputs += self._fail(failed, f"{type(e).__name__}: {e}")
            return
        sampled = [
            (seq, token_id, seq.fill_placeholder(token_id))
            for seq, token_id in zip(out.seqs, token_ids)
            if token_id is not None and not seq.is_finished
        ]
        self.scheduler.publish(out)  # before a grammar that ends a sequence frees its blocks
        fed = [(seq, token_id) for seq, token_id, _ in sampled if seq.grammar is not None]
        if fed:
            self._advance_grammars(fed)
        received.append((out, launched, sampled))

    def _advance(self, out, launched, sampled: list) -> list[RequestOutput]:
        """The rest of a received step: logprobs, fork n > 1 requests, check stops, and build outputs."""
        now = time.monotonic()
        if launched.logprob_rows or launched.prompt_rows:
            self._record_logprobs(out.seqs, sampled, launched)
        if self.transfers is not None:
            self.transfers.write_behind()
        self.num_steps += 1
        touched = {}
        for seq, token_id, pos in sampled:
            req = self.requests.get(seq.request_id)
            if req is None:  # failed meanwhile (its output is out already)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            if pos == seq.num_prompt_tokens and seq.index == 0 and len(req.seqs) < req.params.n:
                self._fork(req, seq)
            self.num_generated_tokens += 1
            if not seq.is_finished:  # its grammar may have ended it on receipt
                self._check_stop(req, seq, token_id)
            touched[req.request_id] = req
        outputs = []
        interval = self.stream_interval()
        for req in touched.values():
            if req.finished:
                del self.requests[req.request_id]
                outputs.append(self._output(req))
            elif req.stream and self._stream_now(req, interval):  # an output copies every token list
                outputs.append(self._output(req))
        return outputs

    def stream_interval(self) -> int:
        """Steps between a stream's outputs now: the configured number, else what the streams' relay
        asks for at this many running sequences (relay_interval), else 1."""
        if self.config.stream_interval is not None:
            return self.config.stream_interval
        if self.relay_interval is None:
            return 1
        return self.relay_interval(len(self.scheduler.running))

    def _flush_held(self, preempted: list[Sequence]) -> list[RequestOutput]:
        """Streams of preempted sequences: the tokens they held back for a longer chunk go out now,
        not when they return (a wait for free blocks may take seconds)."""
        flushed = []
        for seq in preempted:
            req = self.requests.get(seq.request_id)
            if req is not None and req.stream and req.held_steps:
                req.held_steps = 0
                flushed.append(self._output(req))
        return flushed

    @staticmethod
    def _stream_now(req: Request, interval: int) -> bool:
        """A streaming request's output this step? Its first at once, then every interval-th."""
        held = req.held_steps
        if held is not None and held + 1 < interval:
            req.held_steps = held + 1
            return False
        req.held_steps = 0
        return True

    def _record_logprobs(self, seqs: list[Sequence], sampled: list, launched) -> None:
        rows, prompt = self.runner.collected_logprobs(launched)
        # a row whose sequence finished before its token came (an abort, a stop seen late) is not
        # its output; usually none did, and every row is taken without a lookup
        kept = None if not rows or len(sampled) == len(launched.token_ids) else {id(seq) for seq, _, _ in sampled}
        for seq, data, logprob in rows:
            if kept is None or id(seq) in kept:
                seq.logprob_rows.frombytes(data)
                seq.cumulative_logprob += logprob
        for seq in seqs:
            if seq.seq_id not in prompt or seq.request_id not in self.requests:
                continue
            first, dicts = prompt[seq.seq_id]
            have = self.requests[seq.request_id].prompt_logprobs
            for j, d in enumerate(dicts):  # a recomputed prompt (preemption) adds nothing twice
                if have is not None and first + j == len(have):
                    have.append(d)

    def _check_stop(self, req: Request, seq: Sequence, token_id: int) -> None:
        p = seq.params
        detok = req.detoks[seq.index]
        if not p.min_tokens or seq.num_output_tokens >= p.min_tokens:  # below it: no stop yet
            if self._stopped(req, seq, token_id, detok):
                return
        else:
            detok.add(token_id)
        if seq.num_output_tokens >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            detok.flush()
            self._finish(req, seq, "length")

    def _stopped(self, req: Request, seq: Sequence, token_id: int, detok) -> bool:
        """EOS, a stop token or a stop string: finish seq (True). The token's text joins the output
        unless it is EOS or a stop token."""
        p = seq.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            self._finish(req, seq, "stop")
            return True
        if token_id in req.stop_token_ids:
            self._finish(req, seq, "stop", token_id)
            return True
        delta = detok.add(token_id)
        if p.stop and delta:
            text = detok.text
            for s in p.stop:
                at = text.find(s, max(0, len(text) - len(delta) - len(s) + 1))
                if at >= 0:
                    detok.text = text[:at]
                    self._finish(req, seq, "stop", s)
                    return True
        return False

    def _advance_grammars(self, fed: list[tuple[Sequence, int]]) -> None:
        """Feed each grammar its sequence's token (one call for the step's rows). A refused token ends
        its sequence as an error (the mask allowed it: a bug, shown), a completed text as a stop
        (ignore_eos or not); the others' next masks start filling while this thread goes on."""
        live = []
        results = structured.accept_tokens([seq.grammar for seq, _ in fed], [t for _, t in fed])
        for (seq, token_id), (accepted, terminated) in zip(fed, results, strict=True):
            req = self.requests[seq.request_id]
            if not accepted:
                log.error("request %s: token %d refused by its grammar", req.request_id, token_id)
                self._finish(req, seq, "error")
            elif terminated:
                if token_id not in self.eos_token_ids:
                    req.detoks[seq.index].add(token_id)
                self._finish(req, seq, "stop")
            else:
                live.append(seq.grammar)
        if live:
            structured.fill_ahead(live)

    def _finish(self, req: Request, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Retire one sequence of req (it must not be finished yet)."""
        if seq.grammar is not None:
            seq.grammar.drop_ahead()  # (its batch's masks may be large: not kept for a finished sequence)
        self.scheduler.finish(seq)
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        req.num_finished += 1

    def _fail(self, request_ids: set[str], message: str) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            req = self.requests.pop(request_id)
            req.error = message
            for seq in req.seqs:
                if not seq.is_finished:
                    self._finish(req, seq, "error")
            outputs.append(self._output(req, final=True))
        return outputs

    def _output(self, req: Request, final: bool = False) -> RequestOutput:
        completions = []
        for seq, detok in zip(req.seqs, req.detoks):
            text = detok.text
            if seq.params.stop and not seq.is_finished:  # hold back what may become a stop string
                hold = max((k for s in seq.params.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
                text = text[: len(text) - hold]
            completion = CompletionOutput(seq.index, text, seq.output_token_ids, seq.finish_reason, seq.stop_reason)
            if seq.params.logprobs is not None:
                k = seq.params.logprobs  # rows recorded so far (a token not yet recorded gets none)
                rows = min(len(completion.token_ids), len(seq.logprob_rows) // (2 + 2 * k))
                completion.logprobs = TokenLogprobs(seq.logprob_rows, k, rows)
                completion.cumulative_logprob = seq.cumulative_logprob
            completions.append(completion)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            completions,
            req.seqs[0].num_cached_tokens,
            final or req.finished,
            req.error,
            req.arrival_time,
            req.first_token_time,
            list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )

    # ---- introspection --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        live = [seq for req in self.requests.values() for seq in req.seqs if not seq.is_finished]
        self.block_manager.check_invariants(live)
        self.scheduler.check_invariants()

    def stats(self) -> dict:
        tiers = (
            self.tiers.stats()
            if self.tiers is not None
            else {"cpu_blocks_total": 0, "cpu_blocks_used": 0, "disk_blocks": 0, "disk_bytes": 0}
        )
        return {
            **self.block_manager.stats(),
            **tiers,
            "num_running": len(self.scheduler.running),
            "stream_interval": self.stream_interval(),
            "num_waiting": len(self.scheduler.waiting),
            "num_reserved": self.scheduler.num_reserved,  # places kept for samples still to fork
            "num_preemptions": self.scheduler.num_preemptions,
            "num_forks": self.num_forks,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "model": self.model_id,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "attention_backend": self.runner.backend.name,
        }
