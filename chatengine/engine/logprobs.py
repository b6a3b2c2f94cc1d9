"""Logprobs of sampled tokens and of prompt tokens, computed on the device, read back per step.

A sampled row's logprobs come from its processed logits over its temperature (T = 0 rows: plain
log-softmax), the distribution the token was drawn from before top-k / top-p. A prompt row's are
the raw log-softmax. Each row returns the chosen token's logprob and the top k candidates; only
rows that asked for logprobs are computed, so a plain batch pays nothing.
"""

from dataclasses import dataclass

import torch

from chatengine.engine.host_to_device import on_device


@dataclass
class RowLogprobs:
    """Device or host tensors for R rows: token_ids (R,) the token taken (or predicted, for a prompt
    row), chosen (R,) its logprob; top_vals / top_ids (R, K) the K best, best first."""

    token_ids: torch.Tensor
    chosen: torch.Tensor
    top_vals: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self, pin: bool) -> "RowLogprobs":
        """Non-blocking copies into (pinned, on CUDA) host memory: read after the step's event."""
        return RowLogprobs(*(_host_copy(t, pin) for t in (self.token_ids, self.chosen, self.top_vals, self.top_ids)))

    def as_dicts(self, ks: list[int]) -> list[dict[int, float]]:
        """Row r: {token: logprob} of its ks[r] best, then its token if it is not among them."""
        toks, chosen = self.token_ids.tolist(), self.chosen.tolist()
        vals, ids = self.top_vals.tolist(), self.top_ids.tolist()
        out = []
        for r, (k, tok) in enumerate(zip(ks, toks)):
            d = dict(zip(ids[r][:k], vals[r][:k]))
            d.setdefault(tok, chosen[r])
            out.append(d)
        return out


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if not pin:
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@torch.no_grad()
def row_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int, temps: list[float] | None = None) -> RowLogprobs:
    """logits (R, V); chosen (R,) int64 token ids; temps: per row (0 or None: no scaling)."""
    x = logits.float()
    if temps is not None and any(t > 0 and t != 1 for t in temps):
        x = x / on_device([t if t > 0 else 1.0 for t in temps], x.dtype, x.device)[:, None]
    lp = torch.log_softmax(x, dim=-1)
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return RowLogprobs(chosen, lp.gather(1, chosen[:, None]).squeeze(1), top_vals, top_ids)
