"""Llama-family forward over the paged KV cache (Llama 3.x, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3/4,
Gemma 3): one decoder with each family's options from its config: q/k/v biases, per-head q/k norms,
sliding-window layers, SwiGLU or GeGLU, Gemma's sandwich norms, scaled embeddings, (1 + w) norms and
local RoPE, partial rotary. Phi-3's fused qkv_proj / gate_up_proj checkpoints load into the same
fused layers.

Tokens of all sequences in a step are packed into one flat batch of T tokens; attention finds each
token's sequence and context through `AttentionMetadata`. Numerics follow Hugging Face's Llama
(fp32 RMSNorm, rotate-half RoPE), so greedy output matches `generate` token for token in fp32.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chatengine.engine.loader import ModelConfig
from chatengine.engine.models.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
    split,
)
from chatengine.engine.parallel.group import TPGroup
from chatengine.kernels import cpu_fused, cpu_quant, invariant_matmul


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each new token
    cu_seqlens_q: torch.Tensor  # (B+1,) int32: new tokens of sequence b are rows [cu[b], cu[b+1])
    seq_lens: torch.Tensor  # (B,) int32: context length of each sequence after this step
    block_tables: torch.Tensor  # (B, max_pages) int32, padded with -1
    max_seqlen_q: int
    max_seqlen_k: int


class RMSNorm(nn.Module):
    """RMSNorm(x), or with a residual: (RMSNorm(x + residual), x + residual), so the residual add
    rides in the norm's kernel (one launch on the triton backend)."""

    def __init__(self, size: int, eps: float, backend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.backend = eps, backend

    def forward(self, x, residual=None):
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """(rotary_dim / 2,) inverse frequencies; `local`: those of Gemma 3's sliding layers."""
    D = config.rotary_dim or config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    scaling = None if local else config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # the short factors: the context is capped at the original one (loader)
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1+: long wavelengths scaled down, short kept, smooth in between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3, longrope)")


def rope_attention_factor(config: ModelConfig) -> float:
    """LongRoPE scales cos and sin (so q.k) by sqrt(1 + ln(factor) / ln(original context))."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order our heads keep the dims of a partially rotated head in (q and k rows per head are
    permuted at load; q.k is unchanged): rotate-half pairs (i, i + rotary_dim / 2) of the rotated
    dims become (j, j + head_dim / 2), as our full-head kernels pair them, and the passed-through
    dims fill the rest, where the cos/sin tables hold 1 and 0. new dim j = old dim order[j]."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    half = lambda start_rot, start_pass: list(range(start_rot, start_rot + r)) + list(range(start_pass, start_pass + p))  # noqa: E731
    return torch.tensor(half(0, rotary_dim) + half(r, rotary_dim + p))


class RotaryEmbedding(nn.Module):
    """The fp32 cos/sin tables (P, D) that every layer's backend rotates q and k by (`local`: those of
    Gemma 3's sliding layers)."""

    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False):
        super().__init__()
        self.config, self.max_positions, self.local = config, max_positions, local
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim), persistent=False)

    @torch.no_grad()
    def build(self):
        """Fill the cos/sin tables (after the model has its device and dtype)."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.config, self.local).to(device)
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq
        factor = 1.0 if self.local else rope_attention_factor(self.config)
        cos, sin = freqs.cos() * factor, freqs.sin() * factor  # (P, rotary_dim / 2) fp32, cast per use as HF does
        pad = (self.config.head_dim - 2 * freqs.shape[1]) // 2  # passed-through dims: cos 1, sin 0
        if pad:
            cos = torch.cat([cos, torch.ones(cos.shape[0], pad, device=device)], dim=-1)
            sin = torch.cat([sin, torch.zeros(sin.shape[0], pad, device=device)], dim=-1)
        self.cos, self.sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # (P, D)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them on one rank)."""

    def __init__(self, config: ModelConfig, layer: int, backend, group: TPGroup):
        super().__init__()
        self.layer, self.backend = layer, backend
        self.num_heads = split(config.num_heads, group, "num_heads")
        self.num_kv_heads, self.head_dim = kv_heads_per_rank(config.num_kv_heads, group), config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul; loaded from the separate HF weights
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.num_heads,
            self.num_kv_heads,
            config.attention_bias,
            group,
            all_kv_heads=config.num_kv_heads,
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, group)
        self.scale = config.query_scale or self.head_dim**-0.5
        self.window = config.layer_windows[layer] if config.layer_windows else 0  # 0: full attention
        if config.qk_norm:  # weights (head_dim,): the same on every rank
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
        self.qk_norm = config.qk_norm

    def forward(self, x, positions, rope, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per head: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[:, self.layer, 0], kv_cache[:, self.layer, 1]  # (N, bs, Hkv, D) views
        # q rotated; k rotated and v into their cache slots (one launch on triton)
        q = self.backend.rotary_store_kv(positions, q, k, v, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping)
        o = self.backend.attention(q, k_cache, v_cache, meta, self.scale, self.window)  # (T, Hq, D)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend, group: TPGroup):
        super().__init__()
        self.backend = backend
        self.intermediate = split(config.intermediate_size, group, "intermediate_size")  # this rank's share
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, self.intermediate, group)
        self.down_proj = RowParallelLinear(self.intermediate, config.hidden_size, group)
        self.gelu = config.hidden_act == "gelu_tanh"

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        h = self.backend.gelu_tanh_mul(gate_up) if self.gelu else self.backend.silu_mul(gate_up)
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden state so that each residual add
    is fused into the next norm: layer i returns (mlp_out, residual) and layer i+1's input norm adds
    them, as Hugging Face's `residual + mlp_out` followed by its norm does (same rounding).

    Gemma 3 (sandwich norms) also norms each block's output before it joins the residual stream:
    post_attention_layernorm norms the attention output, pre_feedforward_layernorm then takes the
    residual add, and post_feedforward_layernorm norms the MLP output."""

    def __init__(self, config: ModelConfig, layer: int, backend, group: TPGroup):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, backend)
        self.self_attn = Attention(config, layer, backend, group)
        self.post_attention_layernorm = RMSNorm(H, eps, backend)
        self.mlp = MLP(config, backend, group)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(H, eps, backend)
            self.post_feedforward_layernorm = RMSNorm(H, eps, backend)

    def cpu_decode_plan(self, kv_cache: torch.Tensor, rope: "RotaryEmbedding") -> cpu_fused.Layer | None:
        """This layer as one cpu_fused.decode_layer call (a CPU decode step), or None where it is not a
        plain one: the fused kernels off, not every projection in blocks, qk norms, sandwich norms,
        GeGLU, tensor parallel, a cache it cannot index. Built once per (KV pool, RoPE table)."""
        key = (kv_cache.data_ptr(), rope.cos.data_ptr())
        cached = getattr(self, "_cpu_plan", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        k_cache, v_cache = kv_cache[:, attn.layer, 0], kv_cache[:, attn.layer, 1]
        plain = (
            getattr(attn.backend, "fused", False)
            and all(lin.qweight is not None for lin in linears)
            and not (attn.qk_norm or self.sandwich or mlp.gelu or attn.o_proj.group.is_parallel)
            and attn.head_dim % 8 == 0
            and cpu_fused._cache_ok(k_cache, v_cache)
            and rope.cos.dtype == torch.float32
            and self.input_layernorm.weight.dtype == torch.float32
        )
        qls = [cpu_fused.qlinear(lin.qweight, lin.bias) for lin in linears] if plain else []  # type: ignore[arg-type]
        plan = None
        if plain and all(ql is not None for ql in qls):
            plan = cpu_fused.Layer(
                *qls, self.input_layernorm.weight.data_ptr(), self.post_attention_layernorm.weight.data_ptr(),
                self.input_layernorm.eps, attn.scale, self.input_layernorm.weight.shape[0], attn.num_heads,
                attn.num_kv_heads, attn.head_dim, mlp.intermediate, attn.window, k_cache.data_ptr(),
                v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[1], rope.cos.data_ptr(), rope.sin.data_ptr(),
                rope.cos.stride(0),
            )  # fmt: skip
        self._cpu_plan = (key, plan)
        return plan

    def forward(self, x, residual, positions, rope, kv_cache, meta):
        if residual is None:  # first layer: x is the embedding
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(h, positions, rope, kv_cache, meta)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(a, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(a), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaModel(nn.Module):
    """`group`: the tensor-parallel ranks this model's weights are split over (one: the whole model)."""

    def __init__(self, config: ModelConfig, backend, max_positions: int, group: TPGroup | None = None):
        super().__init__()
        self.config = config
        group = group or TPGroup()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, group) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config, max_positions)
        # Gemma 3: its sliding layers rotate with their own base
        self.rope_local = RotaryEmbedding(config, max_positions, local=True) if config.local_rope_theta else None

    def build_rope(self) -> None:
        """Fill the cos/sin tables (after the model has its device and dtype)."""
        for rope in (self.rope, self.rope_local):
            if rope is not None:
                rope.build()

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, logits_indices):
        """input_ids, positions: (T,); returns logits (len(logits_indices), vocab) in the model's dtype
        (the samplers compute in fp32; a bf16 -> fp32 copy of 256 x 128k logits costs 0.1 ms a step)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the weights' dtype, as HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        layer: Any
        fusable = self._cpu_decode_fusable(x, kv_cache, meta)
        step = None  # its int32 copies are made once a layer runs fused
        for layer in self.layers:
            local = self.rope_local is not None and layer.self_attn.window > 0
            rope = self.rope_local if local else self.rope
            plan = layer.cpu_decode_plan(kv_cache, rope) if fusable else None
            if plan is not None:  # the whole layer in one call (cpu_fused.decode_layer)
                step = step or cpu_fused.decode_step(positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
                x, residual = cpu_fused.decode_layer(plan, step, x, residual)
            else:
                x, residual = layer(x, residual, positions, rope, kv_cache, meta)
        assert residual is not None  # every model has at least one layer
        x, _ = self.norm(x[logits_indices], residual[logits_indices])  # only the rows that sample
        return self.lm_head(x)

    def _cpu_decode_fusable(self, x, kv_cache, meta) -> bool:
        """Whether this step is a CPU decode step the one-call layers take (one new token a sequence,
        fp32, rows the GEMV takes; DecoderLayer.cpu_decode_plan says which layers)."""
        T = x.shape[0]
        return (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and kv_cache.dtype == torch.float32
            and meta.max_seqlen_q == 1
            and T == meta.seq_lens.shape[0]
            and 0 < T <= cpu_quant.GEMV_MAX_ROWS
            and cpu_fused.available()
        )

    def quantize_fp8(self) -> None:
        """The attention and MLP projections to e4m3 weights with per-channel scales (after loading)."""
        for linear in [m for m in self.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]:
            linear.quantize_fp8()

    def make_invariant(self) -> None:
        """Deterministic mode: every projection and the LM head through the batch-invariant matmul,
        whose tiles follow the batch size where this device keeps a row's bits across them."""
        kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
        linears = [m for m in self.modules() if isinstance(m, kinds)]
        layers = [(m.weight, m.bias, m.width, m.invariant_segments()) for m in linears]
        by_rows = invariant_matmul.check_tiles(layers)
        if linears and linears[0].group.is_parallel:  # every rank the same way (each checked its shards)
            by_rows = bool(linears[0].group.min_int(int(by_rows)))
        for linear in linears:
            linear.invariant, linear.invariant_by_rows = True, by_rows

    def quantize_blocks(self, fmt: str) -> None:
        """CPU: the attention and MLP projections to GGML-style blocks in `fmt` (q8_0, q4_0, q4_1), the
        LM head to q8_0 (as a GGUF keeps its output or tied embedding table), and a tied embedding
        looks its rows up in the head's blocks, so no fp32 copy of the table stays (after loading)."""
        for linear in [m for m in self.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]:
            if linear.qweight is None:  # (load_hf_state_dict may have done a layer's already)
                linear.quantize_blocks(fmt)
        self._quantize_head()

    def _quantize_head(self) -> None:
        """The LM head to q8_0 blocks (once), a tied embedding looking its rows up in them."""
        if self.lm_head.qweight is None:
            self.lm_head.quantize_blocks("q8_0")
        if self.config.tie_word_embeddings and self.embed_tokens.qweight is None:
            assert self.lm_head.qweight is not None
            self.embed_tokens.share_blocks(self.lm_head.qweight)

    @torch.no_grad()
    def load_hf_state_dict(self, sd, blocks: str | None = None, after_layer: Callable[[], None] | None = None) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up, each rank keeping its slice. `sd` may be
        lazy (a loader's LazyWeights): each tensor is taken (popped) once, so at most one full tensor
        beyond this rank's slices is alive at a time. `blocks` (CPU: q8_0, q4_0, q4_1): each layer's
        projections become blocks as soon as they are loaded, so only one layer's fp32 weights are
        ever resident (the rest of the meta-built model's storage is allocated, never touched);
        `after_layer` then runs (the runner gives the freed memory back to the OS there); the LM head
        becomes q8_0 blocks as soon as its table is in (a tied table straight from the checkpoint's
        tensor, before the first layer, with no fp32 copy of ours)."""
        if self.config.tie_word_embeddings:  # re-tie: to_empty() gives each module fresh storage
            self.lm_head.weight = self.embed_tokens.weight
        own = {n for n, _ in self.named_parameters()}  # names only: a quantized weight's storage goes at once
        names = {n: k for k in sd if (n := _our_name(k)) is not None}  # our name -> the checkpoint's

        def take(name: str) -> torch.Tensor:
            if name not in names:
                raise ValueError(f"weights missing from the checkpoint: [{name!r}]")
            return sd.pop(names.pop(name))

        c = self.config
        qkv_rows = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        order = partial_rotary_order(c.head_dim, c.rotary_dim) if c.rotary_dim else None

        def heads_in_order(x):  # partial rotary: each head's q or k rows into our dim order
            return x if order is None else x.unflatten(0, (-1, c.head_dim))[:, order].flatten(0, 1)

        if blocks is not None and self.config.tie_word_embeddings:  # the table straight into q8_0 blocks
            self.lm_head.quantize_blocks("q8_0", self.lm_head.rows_of(take("embed_tokens.weight")))
            self._quantize_head()  # (the embedding shares them)
            if after_layer is not None:
                after_layer()
        else:
            self.embed_tokens.load(take("embed_tokens.weight"))
        layer: Any
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for param in ("weight", "bias") if attn.qkv_proj.bias is not None else ("weight",):
                if p + f"self_attn.qkv_proj.{param}" in names:  # Phi-3: one tensor, q then k then v rows
                    q, k, v = take(p + f"self_attn.qkv_proj.{param}").split(qkv_rows)
                else:
                    q, k, v = (take(p + f"self_attn.{x}_proj.{param}") for x in "qkv")
                attn.qkv_proj.load(heads_in_order(q), heads_in_order(k), v, param)
            attn.o_proj.load(take(p + "self_attn.o_proj.weight"))
            if p + "mlp.gate_up_proj.weight" in names:  # Phi-3: gate rows, then up rows
                mlp.gate_up_proj.load(*take(p + "mlp.gate_up_proj.weight").chunk(2))
            else:
                mlp.gate_up_proj.load(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
            mlp.down_proj.load(take(p + "mlp.down_proj.weight"))
            if blocks is not None:
                for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                    linear.quantize_blocks(blocks)
                if after_layer is not None:
                    after_layer()
        if not self.config.tie_word_embeddings:
            self.lm_head.load(take("lm_head.weight"))
            if blocks is not None:
                self._quantize_head()
        elif "lm_head.weight" in names:
            take("lm_head.weight")
        replicated = {n for n in own if not any(k in n for k in ("_proj", "embed_tokens", "lm_head"))}
        if replicated - set(names):
            raise ValueError(f"weights missing from the checkpoint: {sorted(replicated - set(names))[:5]}")
        params = dict(self.named_parameters())
        for name in list(names):
            if name not in own:
                raise ValueError(f"unexpected weight {name!r} for a {type(self).__name__}")
            params[name].copy_(take(name).float() + c.norm_offset if "norm" in name else take(name))


def _our_name(checkpoint_name: str) -> str | None:
    """Our parameter name of a checkpoint's (None: not the language model's, e.g. Gemma 3's vision
    tower): text models keep theirs under model., multimodal ones under model.language_model. (or
    language_model.model. in older files)."""
    name = checkpoint_name
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return None if name.startswith(("vision_tower.", "multi_modal_projector.")) else name
