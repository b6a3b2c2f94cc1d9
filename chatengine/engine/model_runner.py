"""ModelRunner: owns the model, the KV pool tensor and the sampler; turns a scheduled batch into
tensors (input ids, positions, slot mapping, block tables), runs the forward and samples.

It reads `seq.block_table` and `seq.num_computed_tokens` but never touches free lists.

The CUDA fast path (bf16 by default):
- One pinned int32 staging buffer holds every index array of a step, filled with numpy (no loop
  over tokens), and goes to the device in one non-blocking copy.
- Pure-decode steps (one new token per sequence) replay a CUDA graph captured for the next batch
  size up (1, 2, 4, 8, 16, 32, ... max_num_seqs) over persistent device buffers. Padded lanes get
  slot -1 (nothing stored) and seq_len 0 (attention reads nothing, writes 0); the decode kernel's
  split count is fixed per graph, so nothing inside a graph syncs with the host.
- A prompt chunk alone replays a one-sequence prefill graph; a step that mixes prompt chunks with
  decodes (a chat turn arriving while others stream) replays a mixed graph padded to (sequences,
  tokens) buckets: padded sequences have no queries, padded tokens store nothing. Eagerly such a
  step's ~160 launches cost the host several times the GPU's work (a 1B model on an H100: ~8 ms
  of host time against ~1.5 ms of device time), and every stream waits for it.
- Sampling without top-k/top-p or per-request seeds runs in one Triton pass over the logits
  (kernels/sampling.py); the token ids are the step's only device-to-host copy.
- `launch` queues a step and returns at once; `collect` waits for its token ids. The engine
  launches step N+1 before it collects step N (async scheduling), so N+1's inputs may hold
  placeholders for tokens step N sampled: those ids are copied on the device from N's samples.
`enforce_eager=True`, the torch attention backend, or a CPU device take the eager path.
"""

import contextlib
import ctypes
import functools
import gc
import itertools
import logging
import math
import mmap
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from chatengine.config import CPU_QUANTIZATIONS, EngineConfig
from chatengine.engine.attention import get_backend
from chatengine.engine.host_to_device import on_device
from chatengine.engine.loader import LoadedModel, ModelConfig
from chatengine.engine.logits_processor import process_logits
from chatengine.engine.logprobs import HostLogprobs, row_logprobs
from chatengine.engine.models.fp8 import check_fp8_device
from chatengine.engine.models.llama import AttentionMetadata, LlamaModel
from chatengine.engine.models.parallel_layers import kv_heads_per_rank, split
from chatengine.engine.parallel import vocab_sampling
from chatengine.engine.parallel.group import TPGroup
from chatengine.engine.parallel.plan import Op, PlanSender
from chatengine.engine.parallel.vocab_sampling import Finish
from chatengine.engine.sampler import Sampler, position_key
from chatengine.engine.sequence import Sequence
from chatengine.kernels import attention_warmup, cache_ops, cpu_quant, logprob_ops, paged_attention, placeholders
from chatengine.kernels import sampling as sampling_ops
from chatengine.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("chatengine")
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the Triton kernel's (KV as the queries)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a captured graph's staged inputs: tokens that store nothing, sequences with no keys
_PADDING = (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 0), ("block_tables", -1))
# how a step's forward runs (the same on every rank)
EAGER, DECODE_GRAPH, PREFILL_GRAPH, MIXED_GRAPH, ONE_SPLIT_DECODE_GRAPH = range(5)
DECODE_GRAPHS = (DECODE_GRAPH, ONE_SPLIT_DECODE_GRAPH)
ALIGN = 32  # staging regions start at multiples of 32 int32 (128 bytes)


def resolve_device_dtype(name: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    device = torch.device(name if name is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return device, DTYPES[dtype]


def context_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The context every rank sizes for: the setting, or the model's capped at 8192."""
    return config.max_model_len or min(mc.max_position_embeddings, 8192)


def _reported(method):
    """Rank 0 of a tensor-parallel engine: a collective that fails because another rank died raises
    a TensorParallelError that names the rank and its error (see PlanSender.guard)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.plan is None:
            return method(self, *args, **kwargs)
        with self.plan.guard():
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class StepMetadata(AttentionMetadata):
    num_splits: int | None = None  # decode: split-KV count fixed for a CUDA graph; None: heuristic


@dataclass
class LaunchedStep:
    """A queued step: which sequences sample, and where their token ids land."""

    samples: list[bool]
    token_ids: torch.Tensor | None = None  # (S,) int64 on the host (pinned on CUDA); None: nothing sampled
    done: Any = None  # CUDA event after the copy into token_ids
    # the sampled rows that asked for logprobs: (sequence, k) each, and their HostLogprobs on the host
    logprob_rows: list[tuple[Sequence, int]] | None = None
    logprobs: HostLogprobs | None = None
    # prompt logprobs: (seq_id, first position predicted, k, count) per sequence, their rows on the host
    prompt_rows: list[tuple[int, int, int, int]] | None = None
    prompt_logprobs: HostLogprobs | None = None


def _prompt_rows_plan(seqs: list[Sequence], num_new_tokens: list[int], wanted: list[bool]):
    """Logits rows of a step where some sequences want prompt logprobs: every row of their chunks
    (the row at position p predicts prompt token p + 1), the last row of the others that sample.
    Returns (token rows (S,) int32, the sampling rows' places among them, spans: (seq, first prompt
    position predicted, first place, count) per wanting sequence)."""
    rows: list[int] = []
    sample_at, spans = [], []
    at = 0
    for seq, n, want in zip(seqs, num_new_tokens, wanted):
        start = seq.num_computed_tokens
        samples = start + n == seq.num_tokens
        if want:
            spans.append((seq, start + 1, len(rows), max(0, min(n, seq.num_prompt_tokens - 1 - start))))
            rows.extend(range(at, at + n))
            if samples:
                sample_at.append(len(rows) - 1)
        elif samples:
            sample_at.append(len(rows))
            rows.append(at + n - 1)
        at += n
    return np.array(rows, dtype=np.int32), sample_at, spans


def _layout(T: int, B: int, S: int, W: int) -> dict[str, tuple[int, int]]:
    """(offset, length) of each index array in the int32 staging buffer, regions 128-byte aligned."""
    sizes = {
        "input_ids": T,
        "positions": T,
        "slot_mapping": T,
        "seq_lens": B,
        "cu_seqlens_q": B + 1,
        "logits_indices": S,
        "block_tables": B * W,
        "temperatures": S,  # float32 bits: the fused sampler's
        "pending_dst": B,
        "pending_src": B,
    }  # placeholder tokens: input row <- last step's sample row
    out, offset = {}, 0
    for name, n in sizes.items():
        out[name] = (offset, n)
        offset += -(-n // ALIGN) * ALIGN
    out["_end"] = (offset, 0)
    return out


class Staging:
    """One step shape's place in the staging buffers: `staging[name]` = (offset, length) of an index
    array, `end` the bytes to upload, `views` the device tensors of each array."""

    def __init__(self, key: tuple[int, int, int, int], offsets: dict[str, tuple[int, int]], dev: torch.Tensor):
        self.key, self.offsets = key, offsets  # key: (T, B, S, W), what another rank rebuilds it from
        self.end = offsets["_end"][0]
        self.views = {name: dev[off : off + n] for name, (off, n) in offsets.items() if name != "_end"}

    def __getitem__(self, name: str) -> tuple[int, int]:
        return self.offsets[name]


class BlockTableRows:
    """Block tables mirrored as rows of one int32 array across steps, so a step converts only the
    entries that are new (a decode step: none, or one every block_size steps) and gathers the batch's
    rows with one numpy take instead of converting every list.

    NOTE: relies on how the block manager edits `seq.block_table`: it only appends to it, or
    replaces it with a new list (free, admission, fork). A row is refreshed whenever the list object
    changes or shrinks, and its last mirrored entry is checked each step."""

    def __init__(self, num_rows: int, width: int):
        self.rows = np.full((num_rows, width), -1, np.int32)
        self.lists: list[list | None] = [None] * num_rows  # the list object each row mirrors
        self.lens = [0] * num_rows
        self.last_step = [0] * num_rows
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free = list(range(num_rows - 1, -1, -1))
        self.step = 0

    def _row(self, seq_id: int) -> int:
        if not self.free:  # forget every sequence not in this step
            for sid, r in list(self.row_of.items()):
                if self.last_step[r] < self.step:
                    del self.row_of[sid]
                    self.lists[r], self.lens[r] = None, 0
                    self.free.append(r)
        if not self.free:  # a step of more sequences than rows (the scheduler keeps it to half): grow
            n, width = self.rows.shape
            self.rows = np.concatenate([self.rows, np.full((n, width), -1, np.int32)])
            self.lists += [None] * n
            self.lens += [0] * n
            self.last_step += [0] * n
            self.free = list(range(2 * n - 1, n - 1, -1))
        r = self.row_of[seq_id] = self.free.pop()
        return r

    def gather(self, seqs: list[Sequence], out: np.ndarray) -> None:
        """out[i, :width] = seqs[i]'s block table padded with -1 (out: (len(seqs), <= width))."""
        self.step += 1
        rows, lens, lists, width = self.rows, self.lens, self.lists, self.rows.shape[1]
        idx = np.empty(len(seqs), np.intp)
        for i, s in enumerate(seqs):
            table = s.block_table
            r = self.row_of.get(s.seq_id)
            if r is None:
                r = self._row(s.seq_id)
                rows, lens, lists = self.rows, self.lens, self.lists  # (grown, maybe)
            n, m = len(table), lens[r]
            if n > width:
                raise ValueError(f"block table of {n} pages is wider than {width} (max_model_len)")
            if lists[r] is not table or n < m or (m and table[m - 1] != rows[r, m - 1]):
                rows[r, :n] = table
                rows[r, n:m] = -1
                lists[r] = table
            elif n > m:
                rows[r, m:n] = table[m:]
            lens[r], self.last_step[r] = n, self.step
            idx[i] = r
        out[:] = rows[idx, : out.shape[1]]


def release_freed_heap() -> None:
    """glibc keeps freed heap memory in the process (RSS) unless asked: after a CPU load has freed the
    fp32 weights it quantized, give it back. A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros that costs memory only where it is written: an anonymous mapping, whose
    pages the OS zero-fills on first touch (the KV pool of a CPU engine: resident as it fills)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))  # anonymous, private; the tensor keeps it alive
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        group: TPGroup | None = None,
        plan: PlanSender | None = None,
    ):
        """`group`: the tensor-parallel ranks (None: this process alone). This runner holds its rank's
        slice of the weights and of every KV page. `plan`: rank 0's pipes to the other ranks, which
        it tells what to run before each forward, page copy or host-tier copy (None on the others:
        they are told). Every rank builds its runner at the same time: the collectives of the pool
        size, the CUDA memory profile and the graph captures pair up, and no op is sent before the
        end (the others run their own profile and captures)."""
        self.config, self.device, self.dtype = config, device, dtype
        self.group, self.plan = group or TPGroup.single(device), None
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        mc = self.model_config = loaded.config
        self.num_heads = split(mc.num_heads, self.group, "num_heads")  # this rank's
        self.num_kv_heads = kv_heads_per_rank(mc.num_kv_heads, self.group)
        self.backend = get_backend(
            config.attention_backend, device.type, config.deterministic, mc.num_kv_heads, mc.head_dim
        )
        with torch.device("meta"):
            model = LlamaModel(mc, self.backend, max_model_len, self.group).to(dtype)
        model.to_empty(device=device)  # in the final dtype: no full-precision copy of the slice
        self.quantization = config.quantization_on(device.type, loaded.gguf_format)
        self.blocks = blocks = self.quantization if self.quantization in CPU_QUANTIZATIONS else None
        if blocks is not None:  # a bad CHATENGINE_CPU_PREFILL fails here, not at the first long prompt
            log.info("CPU %s blocks; prompt-only steps multiply in %s", blocks, cpu_quant.prefill_dtype())
        # CPU blocks: quantized layer by layer, the freed fp32 memory given back after each
        model.load_hf_state_dict(loaded.state_dict, blocks, release_freed_heap if blocks else None)
        if self.quantization == "fp8":
            check_fp8_device(device)
            model.quantize_fp8()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the bf16 weights' memory goes back before the KV pool is sized
        elif self.quantization in CPU_QUANTIZATIONS:
            model.quantize_blocks(self.quantization)
            release_freed_heap()  # the fp32 weights and quantizing temporaries, freed: back to the OS
        if config.deterministic:
            model.make_invariant()
        self.model = model.eval()
        self.model.build_rope()
        self.sampler = Sampler(device, config.seed)
        self._sample_seeds = random.Random(config.seed)  # per-step seeds of the fused sampler
        self.fused_sampling = device.type == "cuda" and self.backend.name == "triton"
        self.eos_token_ids = set(mc.eos_token_ids)  # masked while a request is below its min_tokens
        # staging: sized for the largest step (a full token budget, or max_num_seqs decodes)
        self.max_num_pages = -(-max_model_len // self.block_size) + 1  # block-table width (graphs)
        self.max_graph_bs = min(config.max_num_seqs, config.max_num_batched_tokens)
        max_t = max(config.max_num_batched_tokens, self.max_graph_bs)
        max_b = max(self.max_graph_bs, -(-config.max_num_batched_tokens // max_model_len))  # (the profile's)
        size = _layout(max_t, max_b, max_b, -(-self.max_num_pages // 16) * 16)["_end"][0]
        pin = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(size, dtype=torch.int32, device=device) if pin else self._host
        self._uploaded = torch.cuda.Event() if pin else None
        self._stagings: dict[tuple[int, int, int, int], Staging] = {}  # (T, B, S, W) -> its Staging
        self._iota = np.arange(max_t + max_b + 1, dtype=np.int32)  # aranges a step stages, sliced
        self._tables = BlockTableRows(2 * max_b, -(-self.max_num_pages // 16) * 16)
        # sampled ids come back through two pinned buffers in turn: one step is in flight while the
        # engine reads the one before. Rows for a whole token budget: a step samples at most one a
        # token, whatever its number of sequences
        self._token_host = [torch.zeros(max_t, dtype=torch.int64, pin_memory=True) for _ in range(2)] if pin else None
        self._flip = 0
        # the sampled rows' logprobs come back the same way (made at the first step that asks)
        self._logprob_host: list[torch.Tensor] = []
        self._logprob_flip = 0
        # the last launched step's samples on the device, which the next step's placeholders read
        self._sampled = torch.zeros(max_t, dtype=torch.int64, device=device)
        self._last_rows: dict[int, int] = {}  # seq_id -> its row in _sampled
        # decode graphs fill their placeholders themselves (placeholders.py), so a decode step launches
        # nothing for them; with tensor parallelism rank 0 fills them before it broadcasts the inputs
        self._graph_fills = self.fused_sampling and not self.group.is_parallel
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, logits)
        # invariant mode: decode graphs of one attention split, replayed while every key of the step
        # falls before split_keys (most chats); the others' splits reach max_model_len
        self.one_split_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_graph_steps = 0  # decode steps replayed
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # padded T -> ...
        self.num_prefill_graph_steps = 0  # one-sequence chunks replayed
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # Bp << 16 | Tp -> ...
        self.num_mixed_graph_steps = 0  # steps of chunks and decodes replayed
        self.block_bytes = mc.num_layers * 2 * self.block_size * self.num_kv_heads * mc.head_dim * dtype.itemsize
        with plan.guard() if plan is not None else contextlib.nullcontext():  # a rank that dies: said
            self._make_pool_and_graphs()
        self.plan = plan

    def _make_pool_and_graphs(self) -> None:
        config, mc, dtype, device = self.config, self.model_config, self.dtype, self.device
        # every rank holds the same block ids: the pool is what the tightest rank can hold
        self.num_blocks = self.group.min_int(config.num_kv_blocks or self._num_blocks_from_budget())
        if self.num_blocks < 2:
            raise ValueError(
                f"the KV budget holds only {self.num_blocks} blocks of {self.block_bytes} bytes; "
                "raise kv_cache_gib / gpu_memory_utilization or set num_kv_blocks"
            )
        # page-first: one block is one contiguous span (all layers, K and V)
        page = (mc.num_layers, 2, self.block_size, self.num_kv_heads, mc.head_dim)
        if device.type == "cpu":
            self.kv_cache = lazy_zeros((self.num_blocks, *page), dtype)
        else:
            self.kv_cache = torch.zeros(self.num_blocks, *page, dtype=dtype, device=device)
        self.host_slice: torch.Tensor | None = None  # ranks > 0: their slices of the host tier's pages
        if device.type == "cuda" and self.backend.name == "triton" and self.kv_cache.dtype in _ATTENTION_DTYPES:
            self._warm_up_attention()
        if device.type == "cuda" and not config.enforce_eager:
            if self.backend.name == "triton":
                self._capture_graphs()
            else:  # the torch reference syncs (boolean masks, data-dependent shapes): not capturable
                log.info("CUDA graphs are off: the %r attention backend cannot be captured", self.backend.name)

    def _warm_up_attention(self) -> None:
        """Compile the attention variants eager steps can reach now, not in the middle of serving."""
        t0 = time.perf_counter()
        windows = set(self.model_config.layer_windows or [0])
        n = attention_warmup.warm_up(
            self.kv_cache[:, 0, 0],
            self.kv_cache[:, 0, 1],
            self.num_heads,
            windows,
            self.config.max_num_seqs,
            self.max_model_len,
            self.config.max_num_batched_tokens,
            -(-self.max_num_pages // 16) * 16,  # an eager step's block-table width (_stage)
            getattr(self.backend, "split_keys", 0),
            getattr(self.backend, "key_tile", 0),
        )
        log.info("attention kernels: %d variants ready in %.1f s", n, time.perf_counter() - t0)

    def _num_blocks_from_budget(self) -> int:
        if self.device.type == "cpu":
            return int(self.config.kv_cache_gib * 2**30) // self.block_bytes
        # CUDA: profile one full-budget forward with a throwaway cache, then give the rest to KV
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # the budget as prompts of at most max_model_len tokens (positions stay inside the RoPE table)
        num_tokens = self.config.max_num_batched_tokens
        lens = [min(self.max_model_len, num_tokens - i) for i in range(0, num_tokens, self.max_model_len)]
        pages = [-(-n // self.block_size) for n in lens]
        mc = self.model_config
        self.kv_cache = torch.zeros(
            sum(pages),
            mc.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        seqs, first = [], 0
        for n, k in zip(lens, pages):
            seqs.append(Sequence([0] * n, SamplingParams(), block_size=self.block_size))
            seqs[-1].block_table, first = list(range(first, first + k)), first + k
        self._forward(seqs, lens, whole=True)
        # room for decode-sized logits (a graph's output plus the sampler's temporaries) and for the
        # mixed graphs' outputs, which stay allocated beside each other
        rows = 4 * self.max_graph_bs + sum(b for b, _ in self.mixed_graph_shapes())
        if (self._graph_splits() or 1) > 1:  # the one-split decode graphs' outputs too (fp32 rows)
            rows += sum(self.graph_batch_sizes()) * self.dtype.itemsize // 4
        probe = torch.empty(rows, mc.vocab_size, dtype=torch.float32, device=self.device)
        torch.cuda.synchronize(self.device)
        del self.kv_cache, probe
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        peak, current = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - used - (peak - current)
        return max(int(budget) // self.block_bytes, 0)

    def close(self) -> None:
        """Drop the CUDA graphs (those of a tensor-parallel rank hold NCCL work that must be gone
        before its communicator is), then give the GPU memory back: an engine started later in the
        same process sizes its KV cache from the free memory, and the caching allocator would
        still hold this one's weights and KV cache."""
        self.graphs.clear()
        self.one_split_graphs.clear()
        self.prefill_graphs.clear()
        self.mixed_graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for name in ("kv_cache", "model", "_dev", "_tables", "_sampled", "_logprob_host"):  # (close may run twice)
                self.__dict__.pop(name, None)
            gc.collect()
            torch.cuda.empty_cache()

    # ---- batch tensors ------------------------------------------------------------------------
    def _stage(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: int | None = None,
        pad_tokens: int | None = None,
        logits_rows: np.ndarray | None = None,
        pad_mixed: tuple[int, int] | None = None,
    ):
        """Fill the staging buffer for this step; returns (layout, samples, max_seqlen_q, max_seqlen_k, T,
        num_pending): num_pending input tokens are placeholders that _upload fills on the device.

        pad_to: a decode CUDA graph's batch size. Lanes B..pad_to-1 are decode lanes that do nothing
        (token 0 at position 0, slot -1, seq_len 0), and the block table is pad_to x max_num_pages.
        pad_tokens: a one-sequence prefill graph's token count. Tokens T..pad_tokens-1 store nothing
        (slot -1) and lie past cu_seqlens_q[1], so attention gives them no work; the logits row is
        the chunk's last token.
        logits_rows: (eager only) the token rows to take logits of, when more than the sampling rows
        (prompt logprobs).
        pad_mixed: a mixed graph's (sequences, tokens). Sequences B..Bp-1 have no queries and seq_len
        0, tokens T..Tp-1 store nothing; logits row b is sequence b's last token."""
        if self._uploaded is not None:
            # NOTE: a step that samples nothing (a prompt chunk) never syncs, and a graph replay
            # returns at once: without this wait the host could rewrite the pinned buffer while
            # the previous step's copy of it is still queued (it did, in a chunked prefill).
            self._uploaded.synchronize()
        bs = self.block_size
        B = len(seqs)
        n = np.fromiter(num_new_tokens, np.int32, B)
        start = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, B)
        seq_lens = start + n
        samples = seq_lens == np.fromiter((s.num_tokens for s in seqs), np.int32, B)  # chunk reaches the end
        T = int(n.sum())
        num_pages = np.fromiter((len(s.block_table) for s in seqs), np.int32, B)
        if pad_mixed is not None:
            (Bp, Tp), W = pad_mixed, self.max_num_pages
            S = Bp
        elif pad_tokens is not None:
            Bp, Tp, S, W = 1, pad_tokens, 1, self.max_num_pages
        elif pad_to is None:
            # width a multiple of 16: one Triton specialization of the block-table stride
            Bp, Tp, W = B, T, -(-int(num_pages.max()) // 16) * 16
            S = int(samples.sum()) if logits_rows is None else len(logits_rows)
        else:
            Bp = Tp = S = pad_to
            W = self.max_num_pages
        lay = self._staging(Tp, Bp, S, W)
        h = self._host_np
        assert lay.end <= len(h), "step larger than the staging buffer (max_num_batched_tokens?)"

        def view(name):
            off, length = lay[name]
            return h[off : off + length]

        ids, pos, slots = view("input_ids"), view("positions"), view("slot_mapping")
        if T == B:  # one token each: no slicing
            ids[:B] = np.fromiter((s.token_ids[c] for s, c in zip(seqs, start.tolist())), np.int32, B)
        else:
            ids[:T] = np.fromiter(
                itertools.chain.from_iterable(
                    s.token_ids[c : c + k] for s, c, k in zip(seqs, start.tolist(), n.tolist())
                ),
                np.int32,
                T,
            )
        bt = view("block_tables").reshape(Bp, W)
        self._tables.gather(seqs, bt[:B])
        bt[B:] = -1
        cu = view("cu_seqlens_q")
        iota = self._iota
        decode = T == B  # one token each (a decode step): its token rows are its sequences
        if decode:
            cu[: B + 1] = iota[: B + 1]
        else:
            cu[0] = 0
            np.cumsum(n, out=cu[1 : B + 1])
        token_seq = iota[:B] if decode else np.repeat(iota[:B], n)  # (T,) the sequence of each token
        pending = np.flatnonzero(ids[:T] < 0)  # placeholders: sampled by the last step, on the device
        dst = view("pending_dst")
        if pending.size:
            self._stage_pending(seqs, token_seq[pending], pending, dst, view("pending_src"))
            ids[pending] = 0
        dst[pending.size :] = -1  # lanes without one (a decode graph's fill reads every lane)
        p = start if decode else start[token_seq] + (iota[:T] - cu[token_seq])
        pos[:T] = p
        slots[:T] = bt[token_seq, p // bs] * bs + p % bs
        view("seq_lens")[:B] = seq_lens
        if pad_mixed is not None:  # padded sequences (no queries) and tokens
            ids[T:], pos[T:], slots[T:] = 0, 0, -1
            view("seq_lens")[B:] = 0
            cu[B + 1 :] = T
            li = view("logits_indices")
            li[:B], li[B:] = cu[1 : B + 1] - 1, 0
        elif pad_tokens is not None:  # padded prefill tokens
            ids[T:], pos[T:], slots[T:] = 0, 0, -1
            view("logits_indices")[:] = max(T - 1, 0)
        elif pad_to is None:
            view("logits_indices")[:] = (cu[1 : B + 1] - 1)[samples] if logits_rows is None else logits_rows
        else:  # padded decode lanes
            ids[B:], pos[B:], slots[B:] = 0, 0, -1
            view("seq_lens")[B:] = 0
            cu[B + 1 :] = iota[T + 1 : T + 1 + Bp - B]
            view("logits_indices")[:] = iota[:Bp]
        if self.fused_sampling:
            temps = view("temperatures").view(np.float32)
            temps[: int(samples.sum())] = [s.params.temperature for s, m in zip(seqs, samples.tolist()) if m]
        return lay, samples, int(n.max(initial=1)), int(seq_lens.max(initial=0)), T, int(pending.size)

    def _stage_pending(self, seqs, lanes, dst, dst_view, src_view) -> None:
        """Input rows dst (of sequences seqs[lanes]) take the ids the last launched step sampled."""
        rows = self._last_rows
        try:
            src = [rows[seqs[i].seq_id] for i in lanes.tolist()]
        except KeyError:
            raise RuntimeError("a placeholder token that the last launched step did not sample") from None
        dst_view[: len(src)] = dst
        src_view[: len(src)] = src

    def _staging(self, T: int, B: int, S: int, W: int) -> Staging:
        """The Staging of a step shape, built once: the same few shapes come back step after step."""
        lay = self._stagings.get((T, B, S, W))
        if lay is None:
            if len(self._stagings) >= 512:
                self._stagings.clear()
            lay = self._stagings[T, B, S, W] = Staging((T, B, S, W), _layout(T, B, S, W), self._dev)
        return lay

    def _upload(self, lay: Staging, num_pending: int = 0, graph_fills: bool = False) -> dict[str, torch.Tensor]:
        """One non-blocking copy of the staged prefix, then the placeholder ids from the last step's
        samples (on the device: no sync), unless the decode graph about to run fills them itself
        (`graph_fills`); device views by name."""
        if self._dev is not self._host:
            self._dev[: lay.end].copy_(self._host[: lay.end], non_blocking=True)
            self._uploaded.record()  # the next _stage must not overwrite _host before this copy ran
        d = lay.views
        if num_pending and not graph_fills:
            assert self._last_rows, "pending tokens need a launched step before them"
            dst, src = d["pending_dst"][:num_pending], d["pending_src"][:num_pending]
            if self.fused_sampling:
                placeholders.fill_placeholders_triton(d["input_ids"], self._sampled, dst, src)
            else:
                d["input_ids"][dst] = self._sampled[src].to(torch.int32)
        return d

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """Batch tensors for the scheduled tokens: (input_ids, positions, meta, logits_indices, samples).

        NOTE: the tensors are views of staging buffers that the next step overwrites."""
        lay, samples, max_q, max_k, _, num_pending = self._stage(seqs, num_new_tokens)
        d = self._upload(lay, num_pending)
        B = len(seqs)
        meta = StepMetadata(
            slot_mapping=d["slot_mapping"],
            cu_seqlens_q=d["cu_seqlens_q"],
            seq_lens=d["seq_lens"],
            block_tables=d["block_tables"].view(B, -1),
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
        )
        return d["input_ids"], d["positions"], meta, d["logits_indices"], samples.tolist(), d

    # ---- CUDA graphs (decode; one-sequence prefill) ---------------------------------------------------------------
    def graph_batch_sizes(self) -> list[int]:
        m = self.max_graph_bs
        return sorted({b for b in [1, 2, 4, 8, *range(16, m + 1, 16)] if b <= m} | {m})

    def prefill_graph_sizes(self) -> list[int]:
        """Token counts of the one-sequence prefill graphs: a new chat turn on a cached history is one
        short chunk, and eagerly its ~160 launches cost the host more than the GPU's work."""
        return [t for t in (16, 32, 64, 128, 256, 512) if t <= self.config.max_num_batched_tokens]

    def mixed_graph_shapes(self) -> list[tuple[int, int]]:
        """(sequences, tokens) buckets of the mixed graphs, smallest first."""
        m, budget = self.max_graph_bs, self.config.max_num_batched_tokens
        bs = sorted({min(b, m) for b in (16, 32, 64, 128, 256)})
        ts = sorted({min(t, budget) for t in (256, 512, 1024, 2048)})
        return [(b, t) for b in bs for t in ts if t >= b]

    def _mixed_shape(self, B: int, T: int) -> tuple[int, int] | None:
        """The smallest mixed graph bucket that holds B sequences of T tokens, if any."""
        for b, t in self._mixed_shapes:
            if b >= B and t >= T:
                return b, t
        return None

    def _fill(self, lay: "Staging", values) -> None:
        """Set whole staged views to constants: (name, value) pairs (a graph's all-padding layout)."""
        for name, value in values:
            off, n = lay[name]
            self._host_np[off : off + n] = value

    def _capture(
        self, lay, B: int, max_seqlen_q: int, num_splits: int, pool, fills: bool = False, max_seqlen_k: int = 0
    ):
        """Capture one forward over the staged layout `lay` (all padding: nothing read or stored);
        its replays read whatever a later _stage writes there, with at most `max_seqlen_k` keys a
        sequence (0: max_model_len). `fills`: the graph first fills the placeholder ids (a decode
        graph's). Returns (graph, logits)."""
        d = self._upload(lay)
        meta = StepMetadata(
            slot_mapping=d["slot_mapping"],
            cu_seqlens_q=d["cu_seqlens_q"],
            seq_lens=d["seq_lens"],
            block_tables=d["block_tables"].view(B, self.max_num_pages),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k or self.max_model_len,
            num_splits=num_splits,
        )
        args = (d["input_ids"], d["positions"], self.kv_cache, meta, d["logits_indices"])
        fill = (d["input_ids"], self._sampled, d["pending_dst"], d["pending_src"])
        if fills:
            placeholders.fill_placeholders_triton(*fill)
        self.model(*args)  # compiles the kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            if fills:
                placeholders.fill_placeholders_triton(*fill)
            logits = self.model(*args)
        return graph, logits

    def _graph_splits(self) -> int | None:
        """Invariant mode: a graph's split count, enough fixed-size splits for the whole context."""
        keys = getattr(self.backend, "split_keys", 0)
        return -(-self.max_model_len // keys) if keys else None

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        mc, sms, pool = self.model_config, paged_attention.num_sms(self.device), None
        for bs in reversed(self.graph_batch_sizes()):  # largest first: the others reuse its pool
            lay, *_ = self._stage([], [], pad_to=bs)  # all lanes padded: reads and writes nothing
            block_d = 1 << (mc.head_dim - 1).bit_length()  # the kernel's padded head_dim
            splits = self._graph_splits() or paged_attention._decode_splits(
                bs * self.num_kv_heads, self.max_model_len, sms, block_d
            )
            self.graphs[bs] = self._capture(lay, bs, 1, splits, pool, fills=self._graph_fills)
            pool = self.graphs[bs][0].pool()
            if self._graph_splits() and splits > 1:
                keys = self.backend.split_keys
                self.one_split_graphs[bs] = self._capture(lay, bs, 1, 1, pool, self._graph_fills, max_seqlen_k=keys)
        for Tp in reversed(self.prefill_graph_sizes()):
            lay = self._staging(Tp, 1, 1, self.max_num_pages)  # an empty sequence: no keys, nothing stored
            self._fill(lay, (*_PADDING, ("logits_indices", Tp - 1)))
            off, _ = lay["cu_seqlens_q"]
            self._host_np[off : off + 2] = (0, Tp)
            splits = self._graph_splits() or paged_attention._prefill_splits(
                1, Tp, self.num_heads // self.num_kv_heads, self.num_kv_heads, self.max_model_len, sms
            )
            self.prefill_graphs[Tp] = self._capture(lay, 1, Tp, splits, pool)
            pool = self.prefill_graphs[Tp][0].pool()
        for Bp, Tp in sorted(self.mixed_graph_shapes(), key=lambda bt: (bt[1], bt[0]), reverse=True):
            lay = self._staging(Tp, Bp, Bp, self.max_num_pages)  # empty sequences: no queries, nothing stored
            self._fill(lay, (*_PADDING, ("logits_indices", 0), ("cu_seqlens_q", 0)))
            splits = self._graph_splits() or paged_attention._prefill_splits(
                Bp, Tp, self.num_heads // self.num_kv_heads, self.num_kv_heads, self.max_model_len, sms
            )
            self.mixed_graphs[Bp << 16 | Tp] = self._capture(lay, Bp, Tp, splits, pool)
            pool = self.mixed_graphs[Bp << 16 | Tp][0].pool()
        torch.cuda.synchronize(self.device)
        self._graph_sizes = sorted(self.graphs)
        self._prefill_sizes = sorted(self.prefill_graphs)
        self._mixed_shapes = sorted((k >> 16, k & 0xFFFF) for k in self.mixed_graphs)

    # ---- forward and sampling --------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, seqs, num_new_tokens, whole: bool = False):
        """Queue the forward; returns (logits of the sampling rows, samples, device views of the step,
        prompt rows: (seq, first position predicted, its logits rows) per sequence that wants prompt
        logprobs, the step's Finish, the tokens drawn or None). With tensor parallelism the logits are
        whole rows unless `finish.slices` (each rank's slice, the tokens drawn from them here:
        vocab_sampling.py); `whole`: always whole rows."""
        B = len(seqs)
        wanted = [
            s.index == 0 and s.params.prompt_logprobs is not None and s.num_computed_tokens < s.num_prompt_tokens - 1
            for s in seqs
        ]
        prompt_plan = _prompt_rows_plan(seqs, num_new_tokens, wanted) if any(wanted) else None
        if prompt_plan is not None:  # every row of these chunks: eager
            mode, key = EAGER, B
            lay, samples, max_q, max_k, _, num_pending = self._stage(seqs, num_new_tokens, logits_rows=prompt_plan[0])
        elif self.graphs and B <= self.max_graph_bs and max(num_new_tokens) == 1:
            mode = DECODE_GRAPH
            key = next(b for b in self._graph_sizes if b >= B)
            lay, samples, max_q, max_k, _, num_pending = self._stage(seqs, num_new_tokens, pad_to=key)
            if key in self.one_split_graphs and max_k <= self.backend.split_keys:
                mode = ONE_SPLIT_DECODE_GRAPH
        elif self.prefill_graphs and B == 1 and num_new_tokens[0] <= self._prefill_sizes[-1]:
            mode = PREFILL_GRAPH
            key = next(t for t in self._prefill_sizes if t >= num_new_tokens[0])
            lay, samples, max_q, max_k, _, num_pending = self._stage(seqs, num_new_tokens, pad_tokens=key)
        elif self.mixed_graphs and (shape := self._mixed_shape(B, sum(num_new_tokens))) is not None:
            mode, key = MIXED_GRAPH, shape[0] << 16 | shape[1]
            lay, samples, max_q, max_k, _, num_pending = self._stage(seqs, num_new_tokens, pad_mixed=shape)
        else:
            mode, key = EAGER, B
            lay, samples, max_q, max_k, _, num_pending = self._stage(seqs, num_new_tokens)
        finish = self._finish(mode, seqs, samples, prompt_plan is not None, whole)
        d = self._upload(lay, num_pending, graph_fills=mode in DECODE_GRAPHS and self._graph_fills)
        if self.plan is not None:  # the other ranks run the same forward on their slices
            self.plan.send(Op.FORWARD, mode, key, max_q, max_k, *lay.key, finish)
            self.group.broadcast(self._dev[: lay.end])  # with this step's sampled placeholders filled
        logits = self._finish_logits(self._run(mode, key, d, max_q, max_k), finish)
        drawn = self._draw(logits, d, finish)
        prompt = []
        if prompt_plan is not None:
            _, sample_at, spans = prompt_plan
            prompt = [(seq, first, logits[start : start + count]) for seq, first, start, count in spans]
            logits = logits[on_device(sample_at, torch.long, logits.device)]
        return logits, samples.tolist(), d, prompt, finish, drawn

    def _finish(self, mode: int, seqs: list[Sequence], samples: np.ndarray, prompt: bool, whole: bool) -> Finish:
        """Which logits rows the step reads and how every rank gets them (vocab_sampling.Finish); the
        fused sampler's seed and keys are drawn here, before any rank runs the step. `prompt`: the
        eager prompt-rows layout (prompt logprobs), whose every row is read whole."""
        picked = [seq for seq, s in zip(seqs, samples) if s]
        if not picked and not prompt:
            return Finish(rows=())
        rows: int | tuple[int, ...] | None = None  # eager and prefill graphs: their rows are the ones read
        if not prompt and mode in (*DECODE_GRAPHS, MIXED_GRAPH):  # one row per lane, padded ones too
            rows = len(seqs) if len(picked) == len(seqs) else tuple(np.flatnonzero(samples).tolist())
        if whole:  # a caller that reads the logits, not the sampler
            return Finish(rows=rows)
        params = [seq.params for seq in picked]
        greedy = all(p.temperature == 0 for p in params)
        seed, keys = 0, tuple[int, ...]()
        if self.fused_sampling and any(p.top_k == 0 and p.top_p >= 1 and p.temperature > 0 for p in params):
            seed = self._sample_seeds.getrandbits(31)
            # a seeded row's key: its position is the index of the token sampled now
            keyed = [position_key(s.seed_key, len(s.token_ids)) if s.seed_key else 0 for s in picked]
            keys = tuple(keyed) if any(keyed) else ()
        slices = not prompt and self.group.is_parallel and vocab_sampling.in_slices(params, self.fused_sampling)
        return Finish(rows=rows, slices=slices, greedy=greedy, seed=seed, keys=keys)

    def _draw(self, logits: torch.Tensor, d: dict[str, torch.Tensor], finish: Finish) -> torch.Tensor | None:
        """A step sampled slice by slice: this rank's part of the draw, right after its forward (rank 0
        and the others alike, so no later failure of rank 0 leaves the others' exchange unmatched);
        the tokens (N,), or None for any other step."""
        if not finish.slices:
            return None
        temps = d["temperatures"].view(torch.float32)[: logits.shape[0]]  # staged with the step's inputs
        return vocab_sampling.draw(logits, temps, finish, self.group, self.model_config.vocab_size)

    def _finish_logits(self, logits: torch.Tensor, finish: Finish) -> torch.Tensor:
        """A forward's logits (this rank's slice with tensor parallelism) -> the rows the step reads,
        gathered whole unless each rank draws from its slice (every rank runs this)."""
        if finish.nothing:
            return logits[:0]
        logits = vocab_sampling.select(logits, finish.rows)
        if self.group.is_parallel and not finish.slices:
            logits = self.group.all_gather_last(logits)[..., : self.model_config.vocab_size]
        return logits

    def _run(self, mode: int, key: int, d: dict[str, torch.Tensor], max_q: int, max_k: int) -> torch.Tensor:
        """The forward over a staged step (graph replay or eager): the logits of its logits_indices rows
        (padded rows too, for a graph)."""
        if mode in DECODE_GRAPHS:
            graph, logits = (self.graphs if mode == DECODE_GRAPH else self.one_split_graphs)[key]
            graph.replay()
            self.num_graph_steps += 1
            return logits
        if mode == PREFILL_GRAPH:
            graph, logits = self.prefill_graphs[key]
            graph.replay()
            self.num_prefill_graph_steps += 1
            return logits
        if mode == MIXED_GRAPH:
            graph, logits = self.mixed_graphs[key]
            graph.replay()
            self.num_mixed_graph_steps += 1
            return logits
        meta = StepMetadata(
            slot_mapping=d["slot_mapping"],
            cu_seqlens_q=d["cu_seqlens_q"],
            seq_lens=d["seq_lens"],
            block_tables=d["block_tables"].view(key, -1),
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
        )
        if hasattr(self.backend, "begin_step"):  # torch backend: per-step plan shared by the layers
            self.backend.begin_step(meta, d["positions"])
        # CPU blocks: a step of prompt chunks only may take the prefill GEMM's dtype (cpu_quant.PREFILL)
        prompts_only = self.blocks is not None and bool((d["cu_seqlens_q"].diff() > 1).all())
        with cpu_quant.prefill_step(prompts_only):
            return self.model(d["input_ids"], d["positions"], self.kv_cache, meta, d["logits_indices"])

    @torch.inference_mode()
    def follow_forward(
        self, mode: int, key: int, max_q: int, max_k: int, T: int, B: int, S: int, W: int, finish: Finish
    ) -> None:
        """A rank other than 0: run the forward rank 0 just staged (its staging buffer, broadcast),
        then its part in the step's sampling (`finish`)."""
        lay = self._staging(T, B, S, W)
        self.group.broadcast(self._dev[: lay.end])
        self._draw(self._finish_logits(self._run(mode, key, lay.views, max_q, max_k), finish), lay.views, finish)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], temps: torch.Tensor, finish: Finish) -> torch.Tensor:
        """Sampled ids (len(seqs),) int64 on the device, without a host sync (maybe a view of
        `_sampled`, which the next step's sampling overwrites). logits: processed.
        On CUDA the rows without top-k / top-p take the fused sampler (seeded ones too), the others
        the torch sampler; each row's draw depends only on its own request, never on its neighbours."""
        params = [s.params for s in seqs]
        temps = temps.view(torch.float32)[: len(seqs)]  # staged with the step's inputs
        if not self.fused_sampling:
            return self.sampler(logits.float(), params, [s.generator for s in seqs])
        fused = [i for i, p in enumerate(params) if p.top_k == 0 and p.top_p >= 1]
        if len(fused) == len(seqs):
            out = self._sampled[: len(seqs)]
            return self._sample_fused(logits, temps, finish.greedy, finish.seed, finish.keys, out)
        if not fused:
            return self.sampler(logits.float(), params, [s.generator for s in seqs])
        rest = [i for i, p in enumerate(params) if not (p.top_k == 0 and p.top_p >= 1)]
        out = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        idx = on_device(rest, torch.long, logits.device)
        out[idx] = self.sampler(logits[idx].float(), [params[i] for i in rest], [seqs[i].generator for i in rest])
        idx = on_device(fused, torch.long, logits.device)
        greedy = all(params[i].temperature == 0 for i in fused)
        keys = tuple(finish.keys[i] for i in fused) if finish.keys else ()
        out[idx] = self._sample_fused(logits[idx], temps[idx], greedy, finish.seed, keys)
        return out

    def _sample_fused(
        self, logits: torch.Tensor, temps: torch.Tensor, greedy: bool, seed: int, keys: tuple, out=None
    ) -> torch.Tensor:
        """The fused sampler's draw (greedy, or seeded by `seed` and the rows' `keys`), into `out`
        (N,) int64 if given."""
        if greedy:
            return sampling_ops.greedy_triton(logits, out=out)
        key_t = on_device(list(keys), torch.int64, logits.device) if any(keys) else None
        return sampling_ops.sample_triton(logits, temps, seed, out=out, keys=key_t)

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logits after the requests' processing (a copy in fp32 when any row is processed)."""
        if not any(s.params.processed for s in seqs):
            return logits
        out = logits.float()
        out = out.clone() if out is logits else out  # never edit a graph's output buffer
        process_logits(out, seqs, self.eos_token_ids)
        return out

    def _logprobs(self, logits, seqs, tokens, temps) -> tuple[list[tuple[Sequence, int]] | None, HostLogprobs | None]:
        """The logprobs of the rows that asked for them, copied to the host (non-blocking). On CUDA
        one kernel computes and packs them (logprob_ops); elsewhere the torch reference."""
        meta = [(s, s.params.logprobs) for s in seqs if s.params.logprobs is not None]
        if not meta:
            return None, None
        if len(meta) == len(seqs):
            idx, sub, chosen = None, logits, tokens
        else:
            idx = on_device([i for i, s in enumerate(seqs) if s.params.logprobs is not None], torch.long, logits.device)
            sub, chosen = logits[idx], tokens[idx]
        k = max(k for _, k in meta)
        if self.fused_sampling:
            temps = temps.view(torch.float32)[: len(seqs)]  # staged with the step's inputs
            packed = logprob_ops.row_logprobs_triton(sub, chosen, k, temps if idx is None else temps[idx])
            return meta, HostLogprobs.of(packed, k, pin=True, into=self._next_logprob_host())
        lp = row_logprobs(sub, chosen, k, [s.params.temperature for s, _ in meta])
        return meta, lp.to_host(self._token_host is not None)

    def _next_logprob_host(self) -> torch.Tensor:
        """Two pinned buffers in turn, as the sampled ids': the engine advances step N (reading its
        logprobs) in the step() call that launches N + 1, before N + 2 can copy over N's buffer."""
        if not self._logprob_host:
            size = self._sampled.numel() * (2 + 2 * MAX_LOGPROBS)
            self._logprob_host = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self._logprob_flip ^= 1
        return self._logprob_host[self._logprob_flip]

    def _prompt_logprobs(self, prompt) -> tuple[list[tuple[int, int, int, int]] | None, HostLogprobs | None]:
        """Logprobs of prompt tokens from their predicting rows (raw log-softmax), copied to the host."""
        prompt = [(seq, first, rows) for seq, first, rows in prompt if rows.shape[0]]
        if not prompt:
            return None, None
        targets = [t for seq, first, rows in prompt for t in seq.token_ids[first : first + rows.shape[0]]]
        logits = torch.cat([rows for _, _, rows in prompt])
        chosen = on_device(targets, torch.long, logits.device)
        lp = row_logprobs(logits, chosen, max(seq.params.prompt_logprobs for seq, _, _ in prompt))
        meta = [(seq.seq_id, first, seq.params.prompt_logprobs, rows.shape[0]) for seq, first, rows in prompt]
        return meta, lp.to_host(self._token_host is not None)

    @_reported
    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], num_new_tokens: list[int], between=None) -> LaunchedStep:
        """Queue the forward of the scheduled tokens and the sampling; returns at once on CUDA.
        Sequences whose chunk reaches their last token sample one token each. `between`: called once
        the forward is queued, before the logits are processed (the engine collects the last step)."""
        try:
            return self._launch(seqs, num_new_tokens, between)
        finally:
            if self.plan is not None and self._token_host is not None:  # CUDA, tensor parallel
                with contextlib.suppress(RuntimeError):  # (a broken device: the launch's own error stands)
                    self.plan.track(self._record())  # what it queued, even if it failed part-way

    def _launch(self, seqs: list[Sequence], num_new_tokens: list[int], between) -> LaunchedStep:
        logits, samples, d, prompt, finish, drawn = self._forward(seqs, num_new_tokens)
        if between is not None:
            between()
        step = LaunchedStep(samples)
        if prompt:
            step.prompt_rows, step.prompt_logprobs = self._prompt_logprobs(prompt)
        sampling = [seq for seq, s in zip(seqs, samples) if s]
        if sampling:
            if drawn is not None:  # from each rank's slice of the vocabulary (no row is processed)
                tokens = drawn
            else:
                logits = self._process(logits, sampling)
                tokens = self._sample(logits, sampling, d["temperatures"], finish)
            kept = self._sampled[: len(sampling)]  # the next step's placeholders read these
            if tokens.data_ptr() != kept.data_ptr():  # (the fused sampler draws straight into it)
                kept.copy_(tokens)
            self._last_rows = {seq.seq_id: i for i, seq in enumerate(sampling)}
            step.logprob_rows, step.logprobs = self._logprobs(logits, sampling, tokens, d["temperatures"])
            step.token_ids = tokens
            if self._token_host is not None:
                host = self._token_host[self._flip][: len(sampling)]
                self._flip ^= 1
                step.token_ids = host.copy_(tokens, non_blocking=True)
        if self._token_host is not None and (sampling or step.prompt_rows):
            step.done = self._record()
        return step

    @_reported
    def collect(self, step: LaunchedStep) -> list[int | None]:
        """Wait for a launched step; the sampled token of each sequence (None: mid-prefill)."""
        if step.done is not None:
            step.done.synchronize()
        if self.plan is not None:
            self.plan.collected()
        if step.token_ids is None:
            return [None] * len(step.samples)
        token_ids = iter(step.token_ids.tolist())
        return [next(token_ids) if s else None for s in step.samples]

    @staticmethod
    def collected_logprobs(step: LaunchedStep) -> tuple[list, dict]:
        """After collect: [(sequence, a TokenLogprobs row as float32 bytes, the token's logprob)] of
        the sampled tokens that asked (rows that may view a reused buffer: read them now), and
        {seq_id: (first position, [{token: logprob}] per prompt token from there)}."""
        sampled: list = []
        prompt: dict = {}
        if step.logprobs is not None and step.logprob_rows:
            rows = step.logprobs.flat_rows([k for _, k in step.logprob_rows])
            sampled = [(seq, data, logprob) for (seq, _), (data, logprob) in zip(step.logprob_rows, rows)]
        if step.prompt_logprobs is not None and step.prompt_rows:
            dicts = step.prompt_logprobs.as_dicts([k for _, _, k, count in step.prompt_rows for _ in range(count)])
            at = 0
            for seq_id, first, _, count in step.prompt_rows:
                prompt[seq_id] = (first, dicts[at : at + count])
                at += count
        return sampled, prompt

    def run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[int | None]:
        """launch + collect: one step, synchronously."""
        return self.collect(self.launch(seqs, num_new_tokens))

    @_reported
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages (all layers, K and V) src -> dst, e.g. a forked sequence's partial tail."""
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        if self.plan is not None:
            self.plan.send(Op.COPY_BLOCKS, src, dst)
        self.copy_pages(src, dst)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """This rank's slices of pages src -> dst (rank 0's copy_blocks, on every rank)."""
        src_ids, dst_ids = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        cache_ops.copy_blocks(self.kv_cache, src_ids, dst_ids)

    def make_generator(self, seed: int, index: int) -> torch.Generator:
        return self.sampler.make_generator(seed, index)

    # ---- KV offload: whole pages between the device pool and host memory ----------------------------
    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Pages block_ids as one host tensor (n, num_layers, 2, block_size, kv_heads, head_dim)."""
        ids = torch.tensor(block_ids, device=self.device)
        return self.kv_cache.index_select(0, ids).to("cpu")

    def queue_gather_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """`gather_blocks` without waiting (CUDA): the copy into pinned host memory is queued on the
        compute stream, behind the steps in flight (so it sees what they write), and the host goes on.
        Returns (pages, the event that marks them copied); read the pages only after it. On CPU the
        copy is done on return (event None)."""
        if self.device.type != "cuda":
            return self.gather_blocks(block_ids), None
        pages = torch.empty((len(block_ids), *self.kv_cache.shape[1:]), dtype=self.kv_cache.dtype, pin_memory=True)
        pages.copy_(self._queue_index_select(block_ids), non_blocking=True)
        return pages, self._record()

    # With tensor parallelism each rank keeps its slices of the host tier's pages in its own memory,
    # at the same slots as rank 0's pool: rank 0 names the blocks and slots, every rank copies its
    # slice, so a page's slices always move together. The other ranks' copies queue on their compute
    # stream like rank 0's; their host memory is read by nothing else, so they never wait for them.
    @_reported
    def share_host_pool(self, num_blocks: int) -> None:
        """Rank 0: have the other ranks allocate their slices of a host pool of num_blocks pages."""
        if self.plan is not None:
            self.plan.send(Op.HOST_POOL, num_blocks)

    def make_host_slice(self, num_blocks: int) -> None:
        pin = self.device.type == "cuda"
        self.host_slice = torch.empty((num_blocks, *self.kv_cache.shape[1:]), dtype=self.dtype, pin_memory=pin)

    def save_to_host_slice(self, block_ids: list[int], slots: list[int]) -> None:
        assert self.host_slice is not None, "a host-tier copy before the host pool was made"
        self._save(block_ids, self.host_slice, slots)

    def restore_from_host_slice(self, block_ids: list[int], slots: list[int]) -> None:
        assert self.host_slice is not None, "a host-tier copy before the host pool was made"
        self._restore(block_ids, self.host_slice, slots)

    @_reported
    def queue_save_blocks(self, block_ids: list[int], host_pages: torch.Tensor, slots: list[int]):
        """host_pages[slots[i]] = kv_cache[block_ids[i]], the reverse of `restore_blocks`: on CUDA
        (host_pages pinned) queued on the compute stream behind the steps in flight, without a host
        wait, as one D2H copy per run of consecutive slots; returns the event that marks the copies
        landed. On CPU the copies are done on return (None)."""
        if self.plan is not None:
            self.plan.send(Op.SAVE_BLOCKS, block_ids, slots)
        return self._save(block_ids, host_pages, slots)

    def _save(self, block_ids: list[int], host_pages: torch.Tensor, slots: list[int]):
        if self.device.type != "cuda":
            cache_ops.copy_pages(host_pages, slots, self.kv_cache, block_ids)
            return None
        cache_ops.copy_pages(host_pages, slots, self._queue_index_select(block_ids), list(range(len(block_ids))))
        return self._record()

    def _queue_index_select(self, block_ids: list[int]) -> torch.Tensor:
        """kv_cache[block_ids] as a new contiguous device tensor, the ids uploaded without a host wait."""
        ids = torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        return self.kv_cache.index_select(0, ids)

    def _record(self) -> "torch.cuda.Event":
        done = torch.cuda.Event()
        done.record()
        return done

    @_reported
    def restore_blocks(self, block_ids: list[int], host_pages: torch.Tensor, slots: list[int]):
        """kv_cache[block_ids[i]] = host_pages[slots[i]], straight from the (pinned) host pool: one
        copy per run of consecutive slots and blocks. On CUDA the copies run on a side stream that the
        compute stream then waits for, so the next forward sees the restored pages; returns the event
        that marks them done (the host pool must not overwrite those slots before it), else None."""
        if self.plan is not None:
            self.plan.send(Op.RESTORE_BLOCKS, block_ids, slots)
        return self._restore(block_ids, host_pages, slots)

    def _restore(self, block_ids: list[int], host_pages: torch.Tensor, slots: list[int]):
        if self.device.type != "cuda":
            cache_ops.copy_pages(self.kv_cache, block_ids, host_pages, slots)
            return None
        if not hasattr(self, "copy_stream"):
            self.copy_stream = torch.cuda.Stream(self.device)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            cache_ops.copy_pages(self.kv_cache, block_ids, host_pages, slots)
            done = torch.cuda.Event()
            done.record()
        torch.cuda.current_stream(self.device).wait_event(done)
        return done
