"""ModelRunner: owns the model, the KV pool tensor and the sampler; turns a scheduled batch into
tensors (input ids, positions, slot mapping, block tables), runs the forward and samples.

It reads `seq.block_table` and `seq.num_computed_tokens` but never touches free lists.
"""
import numpy as np
import torch

from chatengine.attention import get_backend
from kernels import cache_ops
from chatengine.config import EngineConfig
from chatengine.loader import LoadedModel
from chatengine.models.llama import AttentionMetadata, LlamaModel
from chatengine.sampler import Sampler
from chatengine.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return device, DTYPES[dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        self.config, self.device, self.dtype = config, device, dtype
        self.block_size = config.block_size
        mc = self.model_config = loaded.config
        self.backend = get_backend(config.attention_backend, device.type)
        with torch.device("meta"):
            model = LlamaModel(mc, self.backend, max_model_len)
        model.to_empty(device=device)
        model.load_hf_state_dict(loaded.state_dict)
        self.model = model.to(dtype).eval()
        self.model.rope.build()
        self.sampler = Sampler(device, config.seed)
        self.block_bytes = mc.num_layers * 2 * self.block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
        self.num_blocks = config.num_kv_blocks or self._num_blocks_from_budget()
        if self.num_blocks < 2:
            raise ValueError(f"the KV budget holds only {self.num_blocks} blocks of {self.block_bytes} bytes; "
                             "raise kv_cache_gib / gpu_memory_utilization or set num_kv_blocks")
        # page-first: one block is one contiguous span (all layers, K and V)
        self.kv_cache = torch.zeros(self.num_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=dtype, device=device)

    def _num_blocks_from_budget(self) -> int:
        if self.device.type == "cpu":
            return int(self.config.kv_cache_gib * 2**30) // self.block_bytes
        # CUDA: profile one full-budget forward with a throwaway cache, then give the rest to KV
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens
        probe_blocks = (num_tokens + self.block_size - 1) // self.block_size
        mc = self.model_config
        self.kv_cache = torch.zeros(probe_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim,
                                    dtype=self.dtype, device=self.device)
        seq = Sequence([0] * num_tokens, None, block_size=self.block_size)
        seq.block_table = list(range(probe_blocks))
        self._forward([seq], [num_tokens])
        torch.cuda.synchronize(self.device)
        del self.kv_cache
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        peak, current = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - used - (peak - current)
        return max(int(budget) // self.block_bytes, 0)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """Batch tensors for the scheduled tokens: (input_ids, positions, meta, logits_indices, sample_mask)."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        cu_seqlens_q, seq_lens, logits_indices, samples = [0], [], [], []
        max_pages = max(len(seq.block_table) for seq in seqs)
        block_tables = np.full((len(seqs), max_pages), -1, dtype=np.int32)
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            table = np.asarray(seq.block_table, dtype=np.int64)
            block_tables[i, :len(table)] = table
            pos = np.arange(start, start + n)
            input_ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            seq_lens.append(start + n)
            samples.append(start + n == seq.num_tokens)     # the chunk reaches the end: sample
            if samples[-1]:
                logits_indices.append(cu_seqlens_q[-1] - 1)

        def t(x, dtype):
            return torch.from_numpy(np.asarray(x)).to(device=self.device, dtype=dtype, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=t(np.concatenate(slots), torch.int64), cu_seqlens_q=t(cu_seqlens_q, torch.int32),
            seq_lens=t(seq_lens, torch.int32), block_tables=t(block_tables, torch.int32),
            max_seqlen_q=max(num_new_tokens), max_seqlen_k=max(seq_lens))
        return (t(np.concatenate(input_ids), torch.int64), t(np.concatenate(positions), torch.int64), meta,
                t(logits_indices, torch.int64), samples)

    @torch.inference_mode()
    def _forward(self, seqs, num_new_tokens):
        input_ids, positions, meta, logits_indices, samples = self.prepare(seqs, num_new_tokens)
        return self.model(input_ids, positions, self.kv_cache, meta, logits_indices), samples

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[int | None]:
        """Forward the scheduled tokens; return the sampled token of each sequence (None: mid-prefill)."""
        logits, samples = self._forward(seqs, num_new_tokens)
        sampling = [seq for seq, s in zip(seqs, samples) if s]
        if not sampling:
            return [None] * len(seqs)
        token_ids = iter(self.sampler(logits, [s.params for s in sampling], [s.generator for s in sampling]).tolist())
        return [next(token_ids) if s else None for s in samples]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages (all layers, K and V) src -> dst, e.g. a forked sequence's partial tail."""
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        cache_ops.copy_blocks(self.kv_cache, src, dst)

    def make_generator(self, seed: int, index: int) -> torch.Generator:
        return self.sampler.make_generator(seed, index)
