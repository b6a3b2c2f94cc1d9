"""EngineConfig: the one dataclass of engine settings."""

from dataclasses import dataclass, fields

# weight formats of the linear layers: "none" (the model's dtype), "fp8" (CUDA, compute capability
# 8.9+), or on the CPU GGML's blocks of 32 weights: "q8_0", "q4_0", "q4_1" (kernels/cpu_quant.py)
QUANTIZATIONS = ("none", "fp8", "q8_0", "q4_0", "q4_1", "gguf")
CPU_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; a .gguf, an HF dir, "dummy:<shape>"
    device: str | None = None  # None: "cuda" when available, else "cpu"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    block_size: int = 16  # tokens per KV page
    enable_prefix_caching: bool = True
    kv_store_dir: str | None = None  # disk tier of the KV cache (persistent prefix cache)
    kv_store_gib: float = 8.0  # disk tier budget
    cpu_offload_gib: float = 0.5  # host tier: evicted device blocks are written back here
    idle_offload_s: float | None = None  # AsyncLLM: move pages idle this long to host memory (None: on demand)
    data_dir: str | None = None  # keeps the server secret (per-user cache salts); None: ephemeral
    register_personas: bool = True  # register prompts/*.md as public shared prefixes at start
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    # a streaming request's output every this many of its steps (its first token and its end at
    # once): fewer, longer chunks cost whoever relays them less per token. None: 1 in one engine; in
    # data-parallel replicas (serve --engine-process's one too) 1 while they run up to 128 streams
    # together, then growing with them up to 4 (their one API process relays every replica's
    # tokens: replica.relay_interval).
    # Streams only (AsyncLLM, replicas, the API); a preempted stream sends what it held back at once
    stream_interval: int | None = None
    max_model_len: int | None = None  # None: the model's context, capped at 8192
    max_n: int = 16  # limit on SamplingParams.n
    max_tokens_limit: int | None = None  # limit on SamplingParams.max_tokens (None: max_model_len)
    num_kv_blocks: int | None = None  # fixes the pool size; None: sized from the memory budget
    kv_cache_gib: float = 1.0  # CPU: KV pool size in GiB
    gpu_memory_utilization: float = 0.85  # CUDA: share of total memory the process may use
    attention_backend: str = "auto"  # "auto" (triton on CUDA, torch on CPU) | "torch" | "triton"
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    async_scheduling: bool | None = None  # schedule step N+1 before step N's tokens are back; None: on CUDA
    tensor_parallel_size: int = 1  # ranks (GPUs) the weights and KV heads are split over; one process each
    # one of QUANTIZATIONS; None: "none". "gguf": on the CPU a GGUF's own block format when its layers
    # share one of CPU_QUANTIZATIONS (lossless: the de-quantized weights re-quantize to the file's
    # blocks). The library's default stays full precision (the tests hold it to transformers' greedy
    # tokens); `chatengine serve` / app.py default to "gguf": faster on a CPU (README, issue #23).
    quantization: str | None = None
    seed: int = 0  # seed of dummy weights and of unseeded sampling
    debug_checks: bool = False  # check block-manager invariants after every step
    # batch- and cache-invariant inference: a request's tokens and logprobs do not depend on its
    # neighbours in a batch, the step's token budget, or how much of its prompt came from a cache tier
    # (kernels/invariant_matmul.py; paged_attention.py split_keys), and on one device or two the same.
    # Slower; weights unquantized; tensor_parallel_size 1 or 2.
    deterministic: bool = False

    def __post_init__(self):
        if not (
            isinstance(self.block_size, int)
            and 1 <= self.block_size <= 256
            and self.block_size & (self.block_size - 1) == 0
        ):
            raise ValueError(f"block_size must be a power of two in [1, 256] (16 is usual), got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        interval = self.stream_interval
        if interval is not None and (type(interval) is not int or not 1 <= interval <= 64):
            raise ValueError(f"stream_interval must be an integer in [1, 64] (steps), got {self.stream_interval!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not isinstance(self.tensor_parallel_size, int) or not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be an integer in [1, 64], got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.kv_store_dir:
            raise ValueError(
                "the disk tier of the KV cache (kv_store_dir) does not work with tensor_parallel_size > 1 yet: "
                "leave kv_store_dir unset, or serve with --no-disk-kv (the host tier works)"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            known = ", ".join(QUANTIZATIONS)
            raise ValueError(f"quantization must be None or one of {known}, got {self.quantization!r}")
        if self.deterministic and self.tensor_parallel_size > 2:
            raise ValueError(
                "deterministic mode runs on one or two devices (its answers are the same on both): "
                "tensor_parallel_size must be 1 or 2"
            )
        if self.deterministic and self.quantization not in (None, "none", "gguf"):  # gguf: then full precision
            raise ValueError("deterministic mode runs unquantized weights: leave quantization unset (or 'none')")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if self.cpu_offload_gib < 0 or self.kv_store_gib <= 0:
            raise ValueError("cpu_offload_gib must be >= 0 and kv_store_gib > 0")

    def quantization_on(self, device_type: str, gguf_format: str | None = None) -> str:
        """The weight format on a device of this type: the setting ("gguf": the GGUF's own block
        format `gguf_format` on the CPU, else none; none in deterministic mode)."""
        cpu = device_type == "cpu" and not self.deterministic  # deterministic: unquantized weights
        own = gguf_format if cpu and gguf_format in CPU_QUANTIZATIONS else "none"
        quantization = own if self.quantization == "gguf" else self.quantization or "none"
        if quantization in CPU_QUANTIZATIONS and device_type != "cpu":
            raise ValueError(f"quantization={quantization!r} runs on the CPU only (use 'fp8' or 'none' on a GPU)")
        return quantization

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise ValueError(f"unknown engine settings {sorted(unknown)}; known: {sorted(names)}")
        return cls(**kwargs)
