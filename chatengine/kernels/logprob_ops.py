"""Logprobs of sampled rows in one pass over the logits, packed for one copy to the host.

`row_logprobs` (engine/logprobs.py, the reference) takes about a dozen torch ops: a float copy, the
temperature, log_softmax, topk over the whole vocabulary, gather, four casts and a cat. With a 128k
vocabulary they cost the host ~1 ms a step of 64 rows, more than the device's work for the step.
Here one program reads one row once: a per-lane online max / sum of exponentials (the
log-normaliser) and a running top-K, merged chunk by chunk (a chunk whose best is below the K-th
kept is skipped). Output row: [token, its logprob, K best logprobs, their token ids] in float32
(HostLogprobs' layout; ids below 2**24 are exact). Ties among the K go to the lower token id.
"""

import torch

from .paged_attention import check_device, jit, tl, triton


@jit
def _row_logprobs_kernel(
    Logits, Chosen, Temps, Out, stride_l, stride_o, vocab_size, K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0)
    temp = tl.load(Temps + row)
    temp = tl.where(temp > 0, temp, 1.0)  # T = 0 rows: the plain log-softmax
    base = Logits + row.to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK_V)
    slots = tl.arange(0, KP)
    mx = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: running max and sum of exp(x - max)
    se = tl.zeros([BLOCK_V], tl.float32)
    top_v = tl.full([KP], float("-inf"), tl.float32)  # the K best so far, best first
    top_i = tl.full([KP], 2147483647, tl.int32)  # an id above every vocabulary's: "none yet"
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs
        x = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32) / temp
        new = tl.maximum(mx, x)
        safe = tl.where(new == float("-inf"), 0.0, new)  # no inf - inf
        se = se * tl.exp(mx - safe) + tl.exp(x - safe)
        mx = new
        if K > 0:
            kth = tl.min(tl.where(slots < K, top_v, float("inf")), 0)
            if tl.max(x, 0) > kth:  # this chunk has a candidate: merge the two lists, best first
                cand = x
                merged_v = tl.full([KP], float("-inf"), tl.float32)
                merged_i = tl.full([KP], 2147483647, tl.int32)
                for j in tl.static_range(K):
                    bx = tl.max(cand, 0)
                    bxi = tl.min(tl.where(cand == bx, cols, 2147483647), 0)
                    bt = tl.max(top_v, 0)
                    bti = tl.min(tl.where(top_v == bt, top_i, 2147483647), 0)
                    from_x = (bx > bt) | ((bx == bt) & (bxi < bti))
                    merged_v = tl.where(slots == j, tl.where(from_x, bx, bt), merged_v)
                    merged_i = tl.where(slots == j, tl.where(from_x, bxi, bti), merged_i)
                    cand = tl.where(cols == bxi, tl.where(from_x, float("-inf"), cand), cand)  # taken: out
                    top_v = tl.where(top_i == bti, tl.where(from_x, top_v, float("-inf")), top_v)
                top_v, top_i = merged_v, merged_i
    m = tl.max(mx, 0)
    lse = m + tl.log(tl.sum(tl.where(mx == float("-inf"), 0.0, se * tl.exp(mx - m)), 0))
    chosen = tl.load(Chosen + row)
    x_chosen = tl.load(base + chosen).to(tl.float32) / temp
    out = Out + row.to(tl.int64) * stride_o
    tl.store(out, chosen.to(tl.float32))
    tl.store(out + 1, x_chosen - lse)
    if K > 0:
        top_i = tl.where(top_i == 2147483647, chosen.to(tl.int32), top_i)  # a row of -inf only: never merged
        tl.store(out + 2 + slots, top_v - lse, mask=slots < K)
        tl.store(out + 2 + K + slots, top_i.to(tl.float32), mask=slots < K)


def row_logprobs_triton(logits: torch.Tensor, chosen: torch.Tensor, k: int, temperatures: torch.Tensor) -> torch.Tensor:
    """Packed (R, 2 + 2k) float32 on the logits' device, as `row_logprobs(...).to_host` packs it.
    logits (R, V) any float dtype, rows contiguous; chosen (R,) int64; temperatures (R,) float32."""
    check_device(logits)
    R, V = logits.shape
    assert logits.stride(1) == 1 and chosen.shape == (R,) and temperatures.shape == (R,)
    assert 0 <= k <= min(20, V), "top logprobs: at most 20, and no more than the vocabulary"
    out = torch.empty(R, 2 + 2 * k, dtype=torch.float32, device=logits.device)
    if R == 0:
        return out
    _row_logprobs_kernel[(R,)](
        logits,
        chosen,
        temperatures.float(),
        out,
        logits.stride(0),
        out.stride(0),
        V,
        K=k,
        KP=max(1, triton.next_power_of_2(k)),
        BLOCK_V=1024,
        num_warps=4,
    )
    return out
