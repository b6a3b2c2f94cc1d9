"""LLMEngine.step(); LLM (the synchronous facade); AsyncLLM (a background loop for asyncio callers).

One step: schedule -> launch the model -> advance the sequences (stop checks, detokenize) -> outputs.

Async scheduling (on by default on CUDA): step() schedules and launches step N+1 before it processes
step N's sampled tokens, so the host's work for N (stop checks, detokenizing, outputs, publishing)
and for scheduling N+1 runs while the GPU computes N+1 instead of between the two. N+1 is
scheduled on placeholders for N's tokens (their ids stay on the device); a sequence that one of
them stops (EOS, a stop string) is found one step later, at the cost of one wasted lane.
"""
import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections import deque

from chatengine.block_manager import BlockManager, owner_tag
from chatengine.config import EngineConfig
from chatengine.hashing import load_or_create_secret, model_fingerprint, user_salt
from chatengine.loader import load_model
from chatengine.model_runner import ModelRunner, resolve_device_dtype
from chatengine.offload import BlockMeta, TieredCache
from chatengine.outputs import CompletionOutput, RequestOutput
from chatengine.sampling_params import SamplingParams
from chatengine.scheduler import Scheduler
from chatengine.sequence import Sequence
from chatengine.tokenizer import IncrementalDetokenizer, apply_chat_template, encode

log = logging.getLogger("chatengine")
KV_LAYOUT = "page-first/v1"


class Request:
    """One prompt and its n samples (sequences)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 user: str | None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.user = params, user
        self.seqs: list[Sequence] = []
        self.detoks: list[IncrementalDetokenizer] = []
        self.error: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_finished = 0             # sequences finished so far (counted by LLMEngine._finish)
        self.stream = True                # False: step() returns its output only once it has finished

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        # read for every request every step: a count, not a scan of the sequences
        return self.num_finished == self.params.n


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device, dtype = resolve_device_dtype(config.device, config.dtype)
        loaded = load_model(config.model, seed=config.seed, dtype=dtype, device=str(device))
        mc = self.model_config = loaded.config
        self.model_id, self.tokenizer = loaded.model_id, loaded.tokenizer
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 8192)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"({mc.max_position_embeddings})")
        self.runner = ModelRunner(config, loaded, device, dtype, self.max_model_len)
        self.weights_digest, self.hf_dir = loaded.weights_digest, loaded.hf_dir
        del loaded
        # the root of every block-hash chain: other weights, dtype or layout can never hit these blocks
        root = model_fingerprint(self.model_id, self.weights_digest, str(dtype), KV_LAYOUT, config.block_size)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, root)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else device.type == "cuda")
        self._in_flight = None                 # (SchedulerOutput, LaunchedStep) not collected yet
        self.tiers = self._make_tiers(root)
        self.block_manager.tiers = self.tiers
        self.block_manager.write_behind = config.kv_store_dir is not None and config.enable_prefix_caching
        # per-user salts derive from this secret; kept on disk so salted blocks outlive restarts
        secret_dir = config.data_dir or config.kv_store_dir
        self.secret = load_or_create_secret(secret_dir) if secret_dir else secrets.token_bytes(32)
        self.eos_token_ids = set(mc.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.personas: dict[str, list[int]] = {}    # name -> token ids of its public prefix
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
        if config.kv_store_dir:   # restores go through host memory: room for at least one whole context
            num_host = max(num_host, self.block_manager.num_blocks_for(self.max_model_len) + 1)
        return TieredCache(root, runner.kv_cache.shape[1:], runner.dtype, num_host, runner.device.type == "cuda",
                           config.kv_store_dir, int(config.kv_store_gib * 2**30))

    def _run_transfers(self) -> None:
        """Copies the schedule asked for, before the forward: evicted pages to host memory first
        (their device blocks may be restore targets), then restores into the device pool."""
        bm, tiers = self.block_manager, self.tiers
        restores, bm.pending_restores = bm.pending_restores, []
        hashes = [h for _, h in restores]
        try:
            self._copy_evictions()
            if restores:
                tiers.copies_in_flight(self.runner.restore_blocks([b for b, _ in restores], tiers.host.data,
                                                                  tiers.host_slots(hashes)))
        except BaseException:   # never leave a published block without its data
            for block_id, _ in restores:
                bm.unpublish(block_id)
            raise
        finally:
            if hashes:
                tiers.unpin(hashes)

    def _device_pages(self, block_ids: list[int]):
        """(block id, host copy of its page) for each of block_ids, gathered 64 pages per copy."""
        for i in range(0, len(block_ids), 64):
            chunk = block_ids[i:i + 64]
            yield from zip(chunk, self.runner.gather_blocks(chunk))

    def _copy_evictions(self) -> None:
        """Write evicted pages back to host memory, or to disk without a host tier: queued on the device
        before anything can overwrite their blocks, behind the step in flight, without a host wait."""
        bm = self.block_manager
        if bm.pending_evictions:
            evicted, bm.pending_evictions = bm.pending_evictions, []
            if self.tiers.host is not None:
                self._save_to_host(evicted)
            else:
                self._queue_to_disk([(b, meta) for b, meta in evicted if meta.hash not in self.tiers.disk], block=True)

    def _save_to_host(self, blocks: list[tuple[int, BlockMeta]]) -> list[bool]:
        """Queue device -> host-memory copies of these (block id, meta) pages into claimed host slots;
        returns whether each page will be in host memory (False: every slot pinned)."""
        tiers, stored, ids, slots, claimed = self.tiers, [], [], [], []
        for block_id, meta in blocks:
            ok, slot = tiers.claim(meta)
            stored.append(ok)
            if slot is not None:
                ids.append(block_id)
                slots.append(slot)
                claimed.append(meta.hash)
        if ids:
            try:
                copied = self.runner.queue_save_blocks(ids, tiers.host.data, slots)
            except BaseException:        # never leave a host entry whose page did not arrive
                tiers.unclaim(claimed)
                raise
            tiers.landing(slots, copied)
        return stored

    def _queue_to_disk(self, blocks: list[tuple[int, BlockMeta]], block: bool) -> None:
        """Queue these (block id, meta) pages for the disk writer, copied off the device behind the
        step in flight (the writer waits for the copy); block=False drops what a full queue cannot take."""
        disk = self.tiers.disk
        for i in range(0, len(blocks), 64):
            chunk = blocks[i:i + 64]
            pages, copied = self.runner.queue_gather_blocks([block_id for block_id, _ in chunk])
            for (_, meta), page in zip(chunk, pages):
                disk.write_behind(meta, page, block=block, ready=copied)

    def _write_behind(self) -> None:
        """Queue newly published pages for the disk store. Their last slots may be written by the step
        in flight (async scheduling): the copies queue behind it on the device and the disk writer
        waits for them, so the host does not wait here and the step keeps its overlap."""
        bm, disk = self.block_manager, self.tiers.disk
        if bm.pending_publishes:
            published, bm.pending_publishes = bm.pending_publishes, []
            todo = [(block_id, meta) for block_id, meta in published if meta.hash not in disk]
            self._queue_to_disk(todo[:disk.reserve(len(todo))], block=False)   # a full queue: dropped before any copy

    def flush_kv(self) -> None:
        """Write every cached block of every tier to the disk store and wait for it."""
        if self.tiers is None or self.tiers.disk is None:
            return
        blocks = self.block_manager.blocks
        hashed = [b.block_id for b in blocks if b.hash is not None]
        for block_id, page in self._device_pages(hashed):
            self.tiers.disk.write_behind(blocks[block_id].meta(), page, block=True)
        self.tiers.flush()

    def offload_cached_blocks(self, max_blocks: int | None = None, idle_for_s: float = 0.0) -> int:
        """Move idle cached pages (free on the device for at least idle_for_s, oldest first) to host
        memory now, freeing the device for active users. Blocks of running requests never move.
        Returns how many moved."""
        bm = self.block_manager
        if self.tiers is None or self.tiers.host is None:
            return 0
        cutoff = time.monotonic() - idle_for_s
        idle = [b for b in bm.free_lru if bm.blocks[b].hash is not None and bm.blocks[b].freed_at <= cutoff]
        idle = idle[:max_blocks]
        for block_id, stored in zip(idle, self._save_to_host([(b, bm.blocks[b].meta()) for b in idle])):
            if stored:       # its copy is queued before any step that could reuse the block
                bm.unpublish(block_id)
                bm.free_lru.move_to_end(block_id, last=False)
        return len(idle)

    def forget_user(self, user: str) -> int:
        """Drop a (deleted) user's cached KV from every tier; returns the number of blocks dropped."""
        owner = owner_tag(user_salt(self.secret, user))
        n = self.block_manager.drop_owner(owner)
        return n + (self.tiers.drop_owner(owner) if self.tiers is not None else 0)

    def close(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = None
        self.flush_kv()
        if self.tiers is not None:
            self.tiers.close()

    # ---- personas -------------------------------------------------------------------------------
    def persona_prefix_ids(self, system_prompt: str) -> list[int]:
        """Token ids that every conversation starting with this system prompt begins with."""
        system = [{"role": "system", "content": system_prompt}]
        a = apply_chat_template(self.tokenizer, system + [{"role": "user", "content": "a"}])
        b = apply_chat_template(self.tokenizer, system + [{"role": "user", "content": "Zz 9"}])
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n]

    def register_persona(self, name: str, system_prompt: str) -> None:
        """Make conversations that open with this system prompt share its KV pages across users."""
        if not isinstance(name, str) or not name:
            raise ValueError("a persona needs a non-empty name")
        if not isinstance(system_prompt, str) or not system_prompt.strip():
            raise ValueError(f"persona {name!r} needs a non-empty system prompt")
        self.personas[name] = self.persona_prefix_ids(system_prompt)

    def public_prefix_len(self, prompt_ids: list[int]) -> int:
        """Length of the registered persona prefix this prompt starts with (0: none, all private)."""
        return max((len(p) for p in self.personas.values() if prompt_ids[:len(p)] == p), default=0)

    # ---- requests -------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, user: str | None = None) -> Request:
        """Validate and tokenize without touching engine state (safe from any thread)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.config.max_n, self.config.max_tokens_limit or self.max_model_len)
        if 0 < params.temperature < 1e-5:   # logits / T would overflow (a denormal T is 0 in fp32): greedy, as vLLM
            params = dataclasses.replace(params, temperature=0.0)
        if isinstance(prompt, str):
            text, ids = prompt, encode(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            # plain ints (the common case) are checked at C speed; anything else one by one
            if (min(ids, default=0) < 0 or max(ids, default=0) >= vocab if set(map(type, ids)) <= {int}
                    else any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids)):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context (max_model_len) is "
                             f"{self.max_model_len}; shorten it to at most {self.max_model_len - 1} tokens")
        need = self.block_manager.num_blocks_for(min(len(ids) + params.max_tokens, self.max_model_len))
        if need > self.block_manager.num_blocks:
            raise ValueError(f"this request needs {need} KV blocks but the pool has {self.block_manager.num_blocks}; "
                             "lower max_tokens or give the engine more KV memory")
        if user is not None and (not isinstance(user, str) or not user):
            raise ValueError("user must be a non-empty string or None")
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex
        return Request(request_id, text, ids, params, user)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        # n > 1: only sample 0 prefills; the others fork from it once the prompt is in the cache
        self.scheduler.add(self._new_seq(req))
        self.requests[req.request_id] = req

    def _new_seq(self, req: Request) -> Sequence:
        i = len(req.seqs)
        seq = Sequence(req.prompt_token_ids, req.params, req.request_id, i, self.config.block_size)
        if req.user is not None:   # single-tenant (user=None) shares everything
            seq.salt = user_salt(self.secret, req.user)
            seq.public_prefix_len = self.public_prefix_len(req.prompt_token_ids)
        if req.params.seed is not None:
            seq.generator = self.runner.make_generator(req.params.seed, i)
        req.seqs.append(seq)
        req.detoks.append(IncrementalDetokenizer(self.tokenizer))
        return seq

    def _fork(self, req: Request, parent: Sequence) -> None:
        """Samples 1..n-1 of a request: share the parent's prompt blocks, copy its partial tail, and
        recompute only the last prompt token (to draw their own first token from their own RNG)."""
        num_tokens = req.num_prompt_tokens - 1
        copies = []
        while len(req.seqs) < req.params.n:
            child = self._new_seq(req)
            if parent.num_computed_tokens < num_tokens:   # preempted meanwhile: prefill from the cache
                self.scheduler.add(child)
                continue
            try:
                copy = self.block_manager.fork(parent, child, num_tokens)
            except MemoryError:        # no room now: it queues and finds the prompt in the prefix cache
                self.scheduler.add(child)
                continue
            if copy is not None:
                copies.append(copy)
            self.scheduler.add_running(child)
            self.num_forks += 1
        if copies:
            if self.tiers is not None:    # a tail may land on a block evicted just now: save its page first
                self._copy_evictions()
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
        out = self.scheduler.schedule()
        launched, outputs = None, []
        if not out.seqs and self._in_flight is None and self.tiers is not None:
            self.tiers.wait_for_loads(0.05)     # only prefixes on their way from disk: no busy loop
        if out.seqs:
            try:
                if self.tiers is not None:
                    self._run_transfers()
                launched = (out, self.runner.launch(out.seqs, out.num_new_tokens))
            except Exception as e:   # fail this step's requests cleanly; the engine serves the others
                log.exception("forward pass failed")
                outputs = self._fail({seq.request_id for seq in out.seqs}, f"{type(e).__name__}: {e}")
            else:
                self.scheduler.launched(out)
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            outputs += self._complete(*previous)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outputs += self._complete(*launched)
        if self.config.debug_checks:
            self.check_invariants()
        return outputs

    def _complete(self, out, launched) -> list[RequestOutput]:
        """A launched step's tokens are back: fill its placeholders, publish the blocks that became
        full, fork n > 1 requests, check stops, and build outputs. Sequences finished meanwhile (a
        stop found late, an abort) are skipped: their lanes were wasted."""
        try:
            token_ids = self.runner.collect(launched)
        except Exception as e:
            log.exception("forward pass failed")
            return self._fail({seq.request_id for seq in out.seqs if not seq.is_finished},
                              f"{type(e).__name__}: {e}")
        now = time.monotonic()
        sampled = [(seq, token_id, seq.fill_placeholder(token_id))
                   for seq, token_id in zip(out.seqs, token_ids) if token_id is not None and not seq.is_finished]
        self.scheduler.publish(out)
        if self.block_manager.pending_publishes:
            self._write_behind()
        self.num_steps += 1
        touched = {}
        for seq, token_id, pos in sampled:
            req = self.requests[seq.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            if pos == seq.num_prompt_tokens and seq.index == 0 and len(req.seqs) < req.params.n:
                self._fork(req, seq)
            self.num_generated_tokens += 1
            self._check_stop(req, seq, token_id)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                del self.requests[req.request_id]
                outputs.append(self._output(req))
            elif req.stream:      # an output copies every token list: only for those who stream
                outputs.append(self._output(req))
        return outputs

    def _check_stop(self, req: Request, seq: Sequence, token_id: int) -> None:
        p = seq.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            self._finish(req, seq, "stop")
            return
        if token_id in p.stop_token_ids:
            self._finish(req, seq, "stop", token_id)
            return
        detok = req.detoks[seq.index]
        delta = detok.add(token_id)
        if p.stop and delta:
            text = detok.text
            for s in p.stop:
                at = text.find(s, max(0, len(text) - len(delta) - len(s) + 1))
                if at >= 0:
                    detok.text = text[:at]
                    self._finish(req, seq, "stop", s)
                    return
        if seq.num_output_tokens >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            detok.flush()
            self._finish(req, seq, "length")

    def _finish(self, req: Request, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Retire one sequence of req (it must not be finished yet)."""
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
            if seq.params.stop and not seq.is_finished:   # hold back what may become a stop string
                hold = max((k for s in seq.params.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
                text = text[:len(text) - hold]
            completions.append(CompletionOutput(seq.index, text, seq.output_token_ids, seq.finish_reason,
                                                seq.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.seqs[0].num_cached_tokens, final or req.finished, req.error,
                             req.arrival_time, req.first_token_time)

    # ---- introspection --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        live = [seq for req in self.requests.values() for seq in req.seqs if not seq.is_finished]
        self.block_manager.check_invariants(live)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_blocks - bm.num_free_blocks,
            "kv_blocks_cached": bm.num_cached_free_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            **(self.tiers.stats() if self.tiers is not None else
               {"cpu_blocks_total": 0, "cpu_blocks_used": 0, "disk_blocks": 0, "disk_bytes": 0}),
            "prefix_cache_hit_rate": bm.num_hit_tokens / bm.num_queried_tokens if bm.num_queried_tokens else 0.0,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "evictions": bm.num_evictions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_forks": self.num_forks,
            "kv_blocks_shared": sum(1 for b in bm.blocks if b.ref_count > 1),
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "model": self.model_id,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "attention_backend": self.runner.backend.name,
        }


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of strings or token-id lists, got {type(prompts).__name__}")


class LLM:
    """Synchronous facade: generate / chat block until every request has finished."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    def generate(self, prompts, sampling_params=None, *, user: str | None = None) -> list[RequestOutput]:
        prompts = _normalize_prompts(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # validate everything before adding anything: a bad prompt leaves nothing half-done
        reqs = [self.engine.make_request(p, sp, user=user) for p, sp in zip(prompts, params)]
        return self._run(reqs)

    def chat(self, messages, sampling_params=None, *, user: str | None = None) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or of such lists)")
        conversations = [messages] if not isinstance(messages[0], list) else messages
        tok = self.engine.tokenizer
        ids = [apply_chat_template(tok, conv) for conv in conversations]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        reqs = [self.engine.make_request(p, sp, user=user) for p, sp in zip(ids, params)]
        for req in reqs:
            req.prompt = tok.decode(req.prompt_token_ids)
        return self._run(reqs)

    def _run(self, reqs: list[Request]) -> list[RequestOutput]:
        engine = self.engine
        for req in reqs:
            req.stream = False    # only final outputs are kept: the engine builds no others
            engine.add(req)
        final = {}
        try:
            while any(req.request_id not in final for req in reqs):
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:   # e.g. KeyboardInterrupt: free every block we hold
            for req in reqs:
                engine.abort(req.request_id)
            raise
        return [final[req.request_id] for req in reqs]

    def get_tokenizer(self):
        return self.engine.tokenizer

    def register_persona(self, name: str, system_prompt: str) -> None:
        self.engine.register_persona(name, system_prompt)

    def stats(self) -> dict:
        return self.engine.stats()

    def forget_user(self, user: str) -> int:
        return self.engine.forget_user(user)

    def shutdown(self) -> None:
        """Abort what runs and flush the KV cache to the disk store (if any)."""
        self.engine.close()


class AsyncLLM:
    """The engine on a background thread; many asyncio callers stream from it at once.

    Callers validate in their own thread (ValueError raised at once), then hand the request to the
    engine thread through an inbox; outputs come back through per-request asyncio queues.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._inbox: deque = deque()              # ("add", req, loop, queue) | ("abort", request_id)
        self._wake = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._stats, self._stats_time = self.engine.stats(), time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="chatengine-loop", daemon=True)
        self._thread.start()

    async def generate(self, prompt, sampling_params=None, *, request_id: str | None = None,
                       user: str | None = None):
        """Yield cumulative RequestOutputs until finished. Closing the generator aborts the request."""
        req = self.engine.make_request(prompt, sampling_params, request_id=request_id, user=user)
        if self._stopped:
            raise RuntimeError("the engine has shut down")
        queue: asyncio.Queue = asyncio.Queue()
        self._post(("add", req, asyncio.get_running_loop(), queue))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True         # refused when added: nothing of ours to abort (the id may be another's)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._post(("abort", req.request_id))

    async def chat(self, messages, sampling_params=None, *, request_id=None, user=None):
        ids = apply_chat_template(self.engine.tokenizer, messages)
        async for out in self.generate(ids, sampling_params, request_id=request_id, user=user):
            yield out

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.engine.eos_token_ids)

    @property
    def max_n(self) -> int:
        return self.engine.config.max_n

    @property
    def is_running(self) -> bool:
        """True while the engine loop is alive and accepting requests."""
        return not self._stopped and self._thread.is_alive()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def register_persona(self, name: str, system_prompt: str) -> None:
        self.engine.register_persona(name, system_prompt)

    def stats(self) -> dict:
        """A snapshot the engine thread publishes (at most every 0.2 s): safe from any thread."""
        return dict(self._stats)

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= 0.2:
            self._stats, self._stats_time = self.engine.stats(), now

    def forget_user(self, user: str) -> None:
        self._post(("forget", user))

    def shutdown(self) -> None:
        """Abort what runs, stop the loop and flush the KV cache to the disk store (if any)."""
        if self._stopped:
            return
        self._stopped = True
        self._post(("stop",))
        self._thread.join(timeout=60)
        self.engine.close()

    def _post(self, item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def _deliver(self, out: RequestOutput | Exception, request_id: str) -> None:
        self._deliver_many([(request_id, out)])

    def _deliver_many(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Hand outputs to their callers' queues with one wake-up per event loop, not one per
        output: each wake-up is a syscall, and a step streams to up to max_num_seqs callers."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}     # loop -> [(request_id, queue, out)]
        for request_id, out in items:
            target = self._queues.get(request_id)
            if target is None:
                continue
            loop, queue = target
            if isinstance(out, Exception) or out.finished:
                del self._queues[request_id]
            batches.setdefault(loop, []).append((request_id, queue, out))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:      # the caller's loop has closed: nobody is listening any more
                for request_id, _, out in batch:
                    if not isinstance(out, Exception) and not out.finished:
                        self.engine.abort(request_id)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            idle_s = engine.config.idle_offload_s
            if not self._inbox and not engine.has_unfinished_requests():
                self._publish_stats(force=True)          # the picture at rest is exact
            with self._wake:
                while not self._inbox and not engine.has_unfinished_requests():
                    if not self._wake.wait(timeout=idle_s) and idle_s is not None:
                        if engine.offload_cached_blocks(idle_for_s=idle_s):   # idle conversations move out
                            self._publish_stats(force=True)
                inbox, self._inbox = self._inbox, deque()
            for item in inbox:
                if item[0] == "stop":
                    for request_id in list(engine.requests):
                        self._deliver(engine.abort(request_id), request_id)
                    return
                if item[0] == "forget":
                    engine.forget_user(item[1])
                    continue
                if item[0] == "add":
                    _, req, loop, queue = item
                    if req.request_id in self._queues:   # a duplicate id must not take over the running stream
                        try:
                            loop.call_soon_threadsafe(queue.put_nowait, ValueError(
                                f"request id {req.request_id!r} is already running"))
                        except RuntimeError:   # that caller's loop has closed
                            pass
                        continue
                    self._queues[req.request_id] = (loop, queue)
                    try:
                        engine.add(req)
                    except ValueError as e:
                        self._deliver(e, req.request_id)
                else:
                    out = engine.abort(item[1])
                    if out is not None:
                        self._deliver(out, item[1])
            try:
                outputs = engine.step()
            except Exception as e:    # a bug outside the forward: fail everything in flight, keep serving
                log.exception("engine step failed")
                outputs = engine._fail(set(engine.requests), f"{type(e).__name__}: {e}")
            self._deliver_many([(out.request_id, out) for out in outputs])
            self._publish_stats()


def _put_all(batch: list[tuple[str, asyncio.Queue, object]]) -> None:
    """Runs on a caller's event loop: one step's outputs for the requests of that loop, in order."""
    for _, queue, out in batch:
        queue.put_nowait(out)
