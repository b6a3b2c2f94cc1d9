"""LLMEngine: requests in, step() out; the scheduler, the model runner and the KV tiers meet here.

One step: schedule -> launch the model -> advance the sequences (stop checks, detokenize) -> outputs.

Async scheduling (on by default on CUDA): step() schedules and launches step N+1 before it processes
step N's sampled tokens, so the host's work for N (stop checks, detokenizing, outputs, publishing)
and for scheduling N+1 runs while the GPU computes N+1 instead of between the two. N+1 is
scheduled on placeholders for N's tokens (their ids stay on the device); a sequence that one of
them stops (EOS, a stop string) is found one step later, at the cost of one wasted lane.
"""
import dataclasses
import logging
import secrets
import time
import uuid

from chatengine.engine.kv.block_manager import BlockManager, owner_tag
from chatengine.config import EngineConfig
from chatengine.engine.kv.hashing import load_or_create_secret, model_fingerprint, user_salt
from chatengine.engine.loader import load_model
from chatengine.engine.model_runner import ModelRunner, resolve_device_dtype
from chatengine.engine.kv.block_meta import BlockMeta
from chatengine.engine.kv.tiers import TieredCache
from chatengine.outputs import CompletionOutput, RequestOutput
from chatengine.sampling_params import SamplingParams
from chatengine.engine.scheduler import Scheduler
from chatengine.engine.request import Request
from chatengine.engine.sequence import Sequence
from chatengine.engine.tokenizer import IncrementalDetokenizer, apply_chat_template, encode

log = logging.getLogger("chatengine")
KV_LAYOUT = "page-first/v1"


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
