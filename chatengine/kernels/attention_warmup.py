"""Compile, before the first request, every paged-attention variant an eager step can reach.

Triton compiles a kernel once per combination of its constexprs (and of the specialization of its
int arguments: == 1, divisible by 16). The CUDA graphs compile theirs at capture, but an eager step
(a prefill chunk, a decode batch beyond the graphs) picks its split count, tile and merge from its
own shapes (`launch_plan`): a variant first met mid-run stopped the engine for ~0.6 s while it
compiled, the TTFT p99 of a chat server at 20 requests/s. Here: the plans of every shape the config
allows, deduplicated, and one launch per variant on a few padded tokens (nothing is read or written
in the cache: every sequence has one key, in block 0, and the outputs are thrown away).
"""

import itertools

import torch

from chatengine.kernels import paged_attention as pa

# the plans read max_seqlen_k only through `k // MIN_SPLIT_KEYS` (capped by MAX_SPLITS) and
# `ceil(k / splits) <= 128`: past this length every k plans like this one
_K_SATURATES = pa.MAX_SPLITS * pa.MIN_SPLIT_KEYS + pa.MIN_SPLIT_KEYS


def _key_lengths(max_model_len: int) -> list[int]:
    """Context lengths where a plan can change: each multiple of MIN_SPLIT_KEYS and the one after."""
    step, top = pa.MIN_SPLIT_KEYS, min(max_model_len, _K_SATURATES)
    ks = {1, top, max_model_len}
    for m in range(step, top + 1, step):
        ks.update((m, m + 1))
    return sorted(k for k in ks if 1 <= k <= max_model_len)


def reachable_plans(
    H_q: int, H_kv: int, D: int, max_num_seqs: int, max_model_len: int, max_num_tokens: int, sms: int
) -> dict[tuple, tuple[int, int, int, int, pa.LaunchPlan]]:
    """{(attention variant, merge variant): (T, B, max_seqlen_q, max_seqlen_k, plan)}, one example per
    variant, over decode batches of 1..max_num_seqs sequences and prefill steps of up to
    max_num_tokens tokens."""
    plans: dict[tuple, tuple[int, int, int, int, pa.LaunchPlan]] = {}

    def add(T: int, B: int, q: int, k: int, plan: pa.LaunchPlan) -> None:
        plans.setdefault((plan.attention_variant(), plan.merge_variant()), (T, B, q, k, plan))

    ks, block_d, seen = _key_lengths(max_model_len), pa.triton.next_power_of_2(D), set()
    for B in range(1, max_num_seqs + 1):  # decode
        # what the batch size changes in a plan: the splits it wants, the tile rule, the merge width
        wants = pa._decode_splits(B * H_kv, _K_SATURATES, sms, block_d)
        # (_decode_launch gives PDL to the split counts s with programs x s <= 4 per multiprocessor)
        pdl_upto = min(wants, 4 * sms // (B * H_kv))
        shape = (wants, B * H_kv < 4 * sms, pdl_upto, pa._merge_heads(B, H_q, sms))
        if shape in seen:
            continue
        seen.add(shape)
        for k in ks:
            add(B, B, 1, k, pa.launch_plan(B, B, H_q, H_kv, D, 1, k, None, sms))
        if B * H_kv >= 8 * sms:  # from here one split and one tile, whatever the batch (_decode_splits)
            break
    # prefill: any split count up to the cap is reachable (few programs, long cached keys), with any
    # merge width that some token count gives; T also bounds the sequences (one token at least each)
    max_splits = max(1, min(pa.MAX_PREFILL_SPLITS, max_model_len // pa.MIN_SPLIT_KEYS))
    widths: dict[int, int] = {}  # merge heads -> a token count that gives them
    for T in range(1, max_num_tokens + 1):
        widths.setdefault(pa._merge_heads(T, H_q, sms), max(2, T))
    for heads, T in widths.items():
        for splits in range(1, max_splits + 1):
            q = min(T, max_model_len)
            add(T, 1, q, max_model_len, pa.launch_plan(T, 1, H_q, H_kv, D, q, max_model_len, splits, sms))
    return plans


@torch.inference_mode()
def warm_up(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    windows: set[int],
    max_num_seqs: int,
    max_model_len: int,
    max_num_tokens: int,
    max_num_pages: int,
    split_keys: int = 0,
    key_tile: int = 0,
) -> int:
    """Compile every reachable variant for one layer's cache views (N, block_size, H_kv, D) and
    each sliding window in use (0: none), with block tables max_num_pages wide as an eager step's
    (their row stride is a specialized int too). `split_keys` > 0 (invariant mode): every step has
    one of four variants, the same tiles (the model's `key_tile`) for decodes (one query a program)
    or chunks, in one split or several (with the merge). Returns the number of launches made."""
    _, _, H_kv, D = k_cache.shape
    device, sms = k_cache.device, pa.num_sms(k_cache.device)
    if split_keys:
        plans = {}
        for T, B, max_q in ((1, 1, 1), (2, 1, 2)):  # a decode; a chunk
            for k in (max_q, max_model_len):  # every key in the first split; for longer contexts, several
                plan = pa.launch_plan(T, B, num_q_heads, H_kv, D, max_q, k, None, sms, split_keys, key_tile)
                plans[(plan.attention_variant(), plan.merge_variant())] = (T, B, max_q, k, plan)
    else:
        plans = reachable_plans(num_q_heads, H_kv, D, max_num_seqs, max_model_len, max_num_tokens, sms)
    n = 0
    block_size = k_cache.shape[1]  # every page is block 0: read, never written
    for T, B, max_q, max_k, plan in plans.values():
        q = torch.zeros(T, num_q_heads, D, dtype=k_cache.dtype, device=device)
        q_lens = [1] * (B - 1) + [T - (B - 1)]  # the last sequence holds the remaining queries
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        seq_lens = torch.tensor(q_lens, dtype=torch.int32, device=device)  # keys: its own queries
        assert max(q_lens) <= max_num_pages * block_size
        block_tables = torch.zeros(B, max_num_pages, dtype=torch.int32, device=device)
        for window in sorted(windows):
            pa.paged_attention_triton(
                q,
                k_cache,
                v_cache,
                cu,
                seq_lens,
                block_tables,
                1.0,
                max_q,
                max_k,
                plan.num_splits,
                window=window,
                split_keys=split_keys,
                key_tile=key_tile,
            )
            n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n
