"""Llama-family forward over the paged KV cache (Llama 3.x, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3):
one decoder with each family's options (q/k/v biases, per-head q/k norms) from its config; Phi-3's
fused qkv_proj / gate_up_proj checkpoints load into the same fused layers.

Tokens of all sequences in a step are packed into one flat batch of T tokens; attention finds each
token's sequence and context through `AttentionMetadata`. Numerics follow Hugging Face's Llama
(fp32 RMSNorm, rotate-half RoPE), so greedy output matches `generate` token for token in fp32.
"""

import math
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


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
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
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """The fp32 cos/sin tables (P, D) that every layer's backend rotates q and k by."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config, self.max_positions = config, max_positions
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim), persistent=False)

    @torch.no_grad()
    def build(self):
        """Fill the cos/sin tables (after the model has its device and dtype)."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.config).to(device)
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.cos, self.sin = emb.cos(), emb.sin()  # fp32 tables, cast per use as HF does


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
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, config.attention_bias, group
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, group)
        self.scale = self.head_dim**-0.5
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
        o = self.backend.attention(q, k_cache, v_cache, meta, self.scale)  # (T, Hq, D)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend, group: TPGroup):
        super().__init__()
        self.backend = backend
        self.intermediate = split(config.intermediate_size, group, "intermediate_size")  # this rank's share
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, self.intermediate, group)
        self.down_proj = RowParallelLinear(self.intermediate, config.hidden_size, group)

    def forward(self, x):
        return self.down_proj(self.backend.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden state so that each residual add
    is fused into the next norm: layer i returns (mlp_out, residual) and layer i+1's input norm adds
    them, as Hugging Face's `residual + mlp_out` followed by its norm does (same rounding)."""

    def __init__(self, config: ModelConfig, layer: int, backend, group: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.self_attn = Attention(config, layer, backend, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.mlp = MLP(config, backend, group)

    def forward(self, x, residual, positions, rope, kv_cache, meta):
        if residual is None:  # first layer: x is the embedding
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(h, positions, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(h), residual


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

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, logits_indices):
        """input_ids, positions: (T,); returns logits (len(logits_indices), vocab) in the model's dtype
        (the samplers compute in fp32; a bf16 -> fp32 copy of 256 x 128k logits costs 0.1 ms a step)."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, kv_cache, meta)
        assert residual is not None  # every model has at least one layer
        x, _ = self.norm(x[logits_indices], residual[logits_indices])  # only the rows that sample
        return self.lm_head(x)

    def quantize_fp8(self) -> None:
        """The attention and MLP projections to e4m3 weights with per-channel scales (after loading)."""
        for linear in [m for m in self.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]:
            linear.quantize_fp8()

    @torch.no_grad()
    def load_hf_state_dict(self, sd) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up, each rank keeping its slice. `sd` may be
        lazy (a loader's LazyWeights): each tensor is taken (popped) once, so at most one full tensor
        beyond this rank's slices is alive at a time."""
        if self.config.tie_word_embeddings:  # re-tie: to_empty() gives each module fresh storage
            self.lm_head.weight = self.embed_tokens.weight
        own = dict(self.named_parameters())
        names = {k.removeprefix("model."): k for k in sd}  # our name -> the checkpoint's

        def take(name: str) -> torch.Tensor:
            if name not in names:
                raise ValueError(f"weights missing from the checkpoint: [{name!r}]")
            return sd.pop(names.pop(name))

        c = self.config
        qkv_rows = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        self.embed_tokens.load(take("embed_tokens.weight"))
        layer: Any
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for param in ("weight", "bias") if attn.qkv_proj.bias is not None else ("weight",):
                if p + f"self_attn.qkv_proj.{param}" in names:  # Phi-3: one tensor, q then k then v rows
                    attn.qkv_proj.load(*take(p + f"self_attn.qkv_proj.{param}").split(qkv_rows), param)
                else:
                    attn.qkv_proj.load(*(take(p + f"self_attn.{x}_proj.{param}") for x in "qkv"), param)
            attn.o_proj.load(take(p + "self_attn.o_proj.weight"))
            if p + "mlp.gate_up_proj.weight" in names:  # Phi-3: gate rows, then up rows
                mlp.gate_up_proj.load(*take(p + "mlp.gate_up_proj.weight").chunk(2))
            else:
                mlp.gate_up_proj.load(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
            mlp.down_proj.load(take(p + "mlp.down_proj.weight"))
        if not self.config.tie_word_embeddings:
            self.lm_head.load(take("lm_head.weight"))
        elif "lm_head.weight" in names:
            take("lm_head.weight")
        replicated = {n for n in own if not any(k in n for k in ("_proj", "embed_tokens", "lm_head"))}
        if replicated - set(names):
            raise ValueError(f"weights missing from the checkpoint: {sorted(replicated - set(names))[:5]}")
        for name in list(names):
            if name not in own:
                raise ValueError(f"unexpected weight {name!r} for a {type(self).__name__}")
            own[name].copy_(take(name))
