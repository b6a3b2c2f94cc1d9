"""Logits processing: what a request's sampling fields do to its row before the draw.

In order (the order SamplingParams documents): logit_bias is added; EOS and stop_token_ids are
masked while fewer than min_tokens were generated; repetition, frequency and presence penalties
read the tokens so far; the structured-output grammar masks what it does not allow next. Rows of
plain requests are never touched, and a batch without processed rows costs one scan of params.

Penalties, grammars and min_tokens read every sampled token on the host. The scheduler runs such a
sequence on a token still in flight only when every running sequence is one; the engine then
collects the step before (filling its placeholders) between queuing this step's forward and
processing its logits, so every token read here is known.
"""

import numpy as np
import torch

from chatengine.engine.host_to_device import on_device
from chatengine.engine.sequence import Sequence


@torch.no_grad()
def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    """In place on logits (N, V) fp32, row i for seqs[i]."""
    rows = [i for i, s in enumerate(seqs) if s.params.processed]
    if not rows:
        return
    _logit_bias(logits, [i for i in rows if seqs[i].params.logit_bias], seqs)
    _min_tokens(logits, [i for i in rows if _below_min_tokens(seqs[i])], seqs, eos_token_ids)
    _penalties(logits, [i for i in rows if seqs[i].params.penalized], seqs)
    grammar_rows = [i for i in rows if getattr(seqs[i], "grammar", None) is not None]
    if grammar_rows:
        _grammar_mask(logits, grammar_rows, seqs)


def _below_min_tokens(seq: Sequence) -> bool:
    # the engine fills every earlier token before processing (only the one sampled now may be pending);
    # a grammar decides itself when its text ends (a complete one allows nothing but EOS)
    return seq.num_output_tokens < seq.params.min_tokens and seq.grammar is None


def _logit_bias(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    if not rows:
        return
    r, t, b = [], [], []
    for i in rows:
        bias = seqs[i].params.logit_bias or {}
        r += [i] * len(bias)
        t += list(bias)
        b += [float(v) for v in bias.values()]
    dev = logits.device
    index = (on_device(r, torch.long, dev), on_device(t, torch.long, dev))
    logits.index_put_(index, on_device(b, logits.dtype, dev), accumulate=True)


def _min_tokens(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    if not rows:
        return
    r, t = [], []
    for i in rows:
        p = seqs[i].params
        banned = set() if p.ignore_eos else set(eos_token_ids)
        banned |= set(p.stop_token_ids or ())
        r += [i] * len(banned)
        t += sorted(banned)
    if r:
        dev = logits.device
        logits[on_device(r, torch.long, dev), on_device(t, torch.long, dev)] = float("-inf")


def _penalties(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """vLLM's and transformers' definitions: repetition over prompt and output tokens (positive
    logits divided, negative multiplied); frequency per output occurrence; presence once."""
    if not rows:
        return
    dev, V = logits.device, logits.shape[1]
    histories = [_history(seqs[i]) for i in rows]
    out_counts = _counts([h.outputs(seqs[i]) for h, i in zip(histories, rows)], V, dev)  # (R, V)
    idx = on_device(rows, torch.long, dev)
    sub = logits[idx]
    rep = on_device([seqs[i].params.repetition_penalty for i in rows], torch.float32, dev)[:, None]
    if any(seqs[i].params.repetition_penalty != 1 for i in rows):  # (a host check: no sync)
        seen = (_counts([h.prompt for h in histories], V, dev) > 0) | (out_counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = on_device([seqs[i].params.frequency_penalty for i in rows], torch.float32, dev)[:, None]
    pres = on_device([seqs[i].params.presence_penalty for i in rows], torch.float32, dev)[:, None]
    sub = sub - freq * out_counts - pres * (out_counts > 0)
    logits[idx] = sub


class TokenHistory:
    """A sequence's known token ids as numpy arrays, the outputs grown by what is new since the
    last step: penalties read every token at every step, and converting the whole Python lists of a
    batch each step cost the host milliseconds."""

    def __init__(self, seq: Sequence):
        self.prompt = np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int64)
        self._out = np.empty(64, dtype=np.int64)
        self._n = 0

    def outputs(self, seq: Sequence) -> np.ndarray:
        """The output token ids the host knows (placeholders excluded; known ones never change)."""
        known, start = seq.num_output_tokens, seq.num_prompt_tokens
        if known > len(self._out):
            self._out = np.resize(self._out, max(known, 2 * len(self._out)))
        if known > self._n:
            self._out[self._n : known] = seq.token_ids[start + self._n : start + known]
        self._n = known
        return self._out[:known]


def _history(seq: Sequence) -> TokenHistory:
    if seq.history is None:
        seq.history = TokenHistory(seq)
    return seq.history


def _counts(token_arrays: list[np.ndarray], V: int, device) -> torch.Tensor:
    """(R, V) fp32: how often each token occurs in each array."""
    width = max(1, max(len(t) for t in token_arrays))
    padded = np.full((len(token_arrays), width), V, dtype=np.int64)  # V pads the rows: a column dropped below
    for r, t in enumerate(token_arrays):
        padded[r, : len(t)] = t
    index = on_device(padded, torch.int64, device)
    counts = torch.zeros(len(token_arrays), V + 1, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :V]


def _grammar_mask(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    from chatengine.engine import structured  # xgrammar loads only when a grammar is used

    live = [i for i in rows if not seqs[i].is_finished]  # (one that finished just now samples a wasted lane)
    if not live:
        return
    structured.mask_logits(logits, [seqs[i].grammar for i in live], live)
