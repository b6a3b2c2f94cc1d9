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

    def to_host(self, pin: bool) -> "HostLogprobs":
        """One non-blocking copy into (pinned, on CUDA) host memory: read after the step's event."""
        columns = [self.token_ids[:, None], self.chosen[:, None], self.top_vals, self.top_ids]
        packed = torch.cat([c.float() for c in columns], dim=1)
        return HostLogprobs.of(packed, self.top_vals.shape[1], pin)


@dataclass
class HostLogprobs:
    """R rows' logprobs on the host, packed (R, 2 + 2K) float32: token, chosen, K values, K ids. One
    transfer and one read instead of four (token ids below 2**24, every vocabulary's, are exact)."""

    packed: torch.Tensor
    k: int

    @staticmethod
    def of(packed: torch.Tensor, k: int, pin: bool, into: torch.Tensor | None = None) -> "HostLogprobs":
        """From a packed (R, 2 + 2k) float32 tensor of the device (logprob_ops): one copy, into the
        front of `into` (a flat float32 host buffer, pinned on CUDA, read before it is reused) if
        given, else into memory of its own."""
        if into is None:
            return HostLogprobs(_host_copy(packed, pin), k)
        host = into[: packed.numel()].view(packed.shape)
        return HostLogprobs(host.copy_(packed, non_blocking=pin), k)

    def flat_rows(self, ks: list[int]) -> list[tuple[bytes | memoryview, float]]:
        """Row r as TokenLogprobs stores it, float32 bytes (token, its logprob, its ks[r] best values,
        their ids), and the token's logprob: appended to a sequence's array with one call. Where
        every row keeps all K, the rows are views of this buffer: read them before it is reused."""
        a = self.packed.numpy()
        K = self.k
        chosen = a[:, 1].tolist()
        # a step's usual case, one k for every row: no copy and no numpy call a row
        if ks and a.flags.c_contiguous and all(k == K for k in ks):
            data, width = a.data.cast("B"), 4 * (2 + 2 * K)
            return list(zip([data[at : at + width] for at in range(0, len(data), width)], chosen, strict=True))
        rows = [
            a[r].tobytes() if k == K else a[r, : 2 + k].tobytes() + a[r, 2 + K : 2 + K + k].tobytes()
            for r, k in enumerate(ks)
        ]
        return list(zip(rows, chosen, strict=True))

    def as_dicts(self, ks: list[int]) -> list[dict[int, float]]:
        """Row r: {token: logprob} of its ks[r] best, then its token if it is not among them."""
        out = []
        ids_at = 2 + self.k
        for k, row in zip(ks, self.packed.tolist()):
            d = dict(zip(map(int, row[ids_at : ids_at + k]), row[2 : 2 + k]))
            d.setdefault(int(row[0]), row[1])
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
