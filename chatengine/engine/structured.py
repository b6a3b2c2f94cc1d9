"""Structured outputs: a request's StructuredOutputs (JSON schema, any JSON object, regex, choice or
EBNF grammar) compiled against this model's tokenizer, and a per-sequence state that says which
tokens may come next as a bitmask over the vocabulary.

xgrammar does the work (a pushdown automaton whose per-token masks are precomputed at compile
time, so a step costs a mask fill per grammar row, not a scan of the vocabulary). This module owns
what the engine relies on: one compiler per engine, built lazily (most engines never see a
grammar), a bounded thread-safe cache keyed by the spec, compile errors as ValueError naming the
field, JSON without free whitespace (a small model cannot loop on spaces), and a terminated
grammar that allows only stop tokens.

Bitmask layout (xgrammar's): int32 (rows, ceil(V / 32)); token t is allowed in a row when bit
t % 32 of word t // 32 is set. Bits beyond V are ignored.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from chatengine.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

CACHE_SIZE = 256  # compiled grammars kept (LRU); a schema's compiled form is KBs to a few MBs ...
CACHE_BYTES = 256 * 2**20  # ... a long grammar's tens of MBs: the cache's bound in bytes too

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a failed check's text
_ERROR_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false:\s*")


def _xgr():
    import xgrammar  # imported on first use: it pulls in transformers and its own runtime

    return xgrammar


def _clean_error(e: Exception) -> str:
    text = str(e).strip()
    text = _CHECK_PREFIX.sub("", _ERROR_PREFIX.sub("", text))
    return text or type(e).__name__


def _ebnf_literal(s: str) -> str:
    """s as an EBNF string literal: quote and backslash escaped, control characters as \\uHHHH
    (a raw newline would end the rule; \\x is greedy, so "\\x0ab" would read as 0xAB); other
    characters, non-ASCII included, stay as they are."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _schema_text(schema: dict | str) -> str:
    """The schema as compact JSON text, the cache key and what xgrammar reads. Key order is kept:
    xgrammar emits properties in the schema's order, so two orders are two grammars."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON text: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json is not a JSON-serialisable schema: {e}") from None


def _spec_key(spec: StructuredOutputs) -> tuple:
    """A canonical, hashable key: equal keys compile to the same grammar."""
    if spec.json is not None:
        return ("json", _schema_text(spec.json))
    if spec.json_object:
        return ("json_object",)
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.choice is not None:
        return ("choice", tuple(spec.choice))
    return ("grammar", spec.grammar)


class Grammars:
    """One per engine: compiles StructuredOutputs for this tokenizer, cached by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int] | list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < self.vocab_size})
        if not self.stop_token_ids:
            raise ValueError("structured outputs need at least one stop token id inside the vocabulary")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _cache; compiles run outside it
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}  # the compiled ones' memory_size_bytes, summed in _bytes
        self._bytes = 0
        # the mask row of a terminated grammar: stop tokens only, (ceil(V/32),) int32
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        for t in self.stop_token_ids:
            words[t >> 5] |= np.uint32(1 << (t & 31))
        self._stop_row = torch.from_numpy(words.view(np.int32))
        self._stops = frozenset(self.stop_token_ids)
        self.tokenizer_info_seconds: float | None = None  # how long the lazy TokenizerInfo build took

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer (this model has none)")
                xgr = _xgr()
                t0 = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # xgrammar's own cache is unbounded; ours (LRU by spec) is the bound
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                self.tokenizer_info_seconds = time.perf_counter() - t0
            return self._compiler

    def compile(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """The compiled grammar of spec (the same object for an equal spec while it is cached).
        ValueError names the field and what was wrong with it."""
        if not isinstance(spec, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")
        spec.validate()
        key = _spec_key(spec)
        with self._lock:
            fut = self._cache.get(key)
            mine = fut is None  # this thread compiles it; others with the same key wait on its Future
            if fut is None:
                fut = self._cache[key] = Future()
                self._evict()
            else:
                self._cache.move_to_end(key)
        if not mine:
            return fut.result()  # re-raises the compiling thread's ValueError if it failed
        try:
            compiled = self._compile(key)
        except BaseException as e:
            with self._lock:  # a failure is not cached: the next call tries again
                if self._cache.get(key) is fut:
                    del self._cache[key]
            fut.set_exception(e)
            raise
        with self._lock:
            if self._cache.get(key) is fut:
                self._sizes[key] = getattr(compiled, "memory_size_bytes", 0)
                self._bytes += self._sizes[key]
                self._evict()
        fut.set_result(compiled)
        return compiled

    def _evict(self) -> None:
        """Oldest first, until within CACHE_SIZE and CACHE_BYTES (the newest stays whatever its
        size). Threads already waiting on an evicted Future keep it. Under self._lock."""
        while len(self._cache) > CACHE_SIZE or (self._bytes > CACHE_BYTES and len(self._cache) > 1):
            key, _ = self._cache.popitem(last=False)
            self._bytes -= self._sizes.pop(key, 0)

    def _compile(self, key: tuple) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        kind = key[0]
        try:
            if kind == "json":
                # no free whitespace: separators are fixed (", " and ": "), so the output is one line
                return compiler.compile_json_schema(key[1], any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                # any object (properties of any JSON type), with the same fixed separators
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(key[1])
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in key[1]))
            return compiler.compile_grammar(key[1], root_rule_name="root")
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choices"}.get(kind, kind)
            hint = {
                "json": ' (a JSON Schema object, e.g. {"type": "object", "properties": {"name": {"type": "string"}}})',
                "grammar": " (EBNF/GBNF: rules as `name ::= ...`, a `root` rule, strings in double quotes)",
            }.get(kind, "")
            raise ValueError(f"structured_outputs.{kind}: invalid {what}: {_clean_error(e)}{hint}") from None

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> GrammarState:
        """A fresh state for one sequence at the start of its output."""
        return GrammarState(_xgr().GrammarMatcher(compiled), self._stop_row, self.vocab_size, self._stops)


class GrammarState:
    """One per generated sequence. The engine's thread uses it; a fill started ahead (`fill_ahead`)
    runs on the grammar worker meanwhile, and every method that touches the matcher first waits for
    that fill, so the matcher is never read by one thread while another changes it."""

    def __init__(self, matcher: Any, stop_row: torch.Tensor, vocab_size: int, stop_token_ids: frozenset[int]):
        self._matcher = matcher
        self._stop_row = stop_row
        self._vocab_size = vocab_size
        self._stops = stop_token_ids  # a matcher terminates only on one of these
        self._terminated = False  # kept here: asked each step, and only a stop token changes it
        # (fill, its bitmask, this state's row there): the next mask, started on the worker for the
        # state as it is now; dropped when the state changes, the fill fails or the sequence ends
        self._ahead: tuple[Future, torch.Tensor, int] | None = None

    def ahead_mask(self) -> tuple[torch.Tensor, int] | None:
        """(bitmask, row) of the next mask filled ahead, once it is made; None if none was started.
        A fill that failed raises here, for this state only."""
        if self._ahead is None:
            return None
        fill, made, at = self._ahead
        errors = fill.result()
        if errors is not None and errors[at] is not None:
            self._ahead = None
            raise errors[at]
        return made, at

    def filling(self) -> bool:
        """A mask filled ahead is still being made (its sampling would wait for it)."""
        return self._ahead is not None and not self._ahead[0].done()

    def drop_ahead(self) -> None:
        """The sequence ended: its mask filled ahead is not needed (a fill may still be running; the
        matcher is not touched again)."""
        self._ahead = None

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it here,
        if it is out of the vocabulary, or if the grammar has already terminated."""
        return accept_tokens([self], [token_id])[0][0]

    def _settle(self) -> None:
        """Wait for a fill ahead (it reads the matcher) and drop it: the matcher is about to change."""
        if self._ahead is not None:
            self._ahead[0].result()  # (the worker returns a failed row's error: it never raises here)
            self._ahead = None

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete text."""
        return self._terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (bitmask: CPU int32 (N, ceil(V/32))): the
        mask filled ahead, or (none, or it failed) one filled now."""
        try:
            ahead = self.ahead_mask()
        except Exception:
            ahead = None
        if ahead is not None:
            bitmask[row].copy_(ahead[0][ahead[1]])
        elif self._terminated:  # xgrammar fills nothing then: allow the stop tokens only
            bitmask[row].copy_(self._stop_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


def accept_tokens(states: list[GrammarState], token_ids: list[int]) -> list[tuple[bool, bool]]:
    """Advance each state by its token, the batch in one xgrammar call: (accepted, terminated) per
    state. A refused token (or one out of the vocabulary) leaves its state unchanged. The engine
    feeds every grammar row of a step at once: one state at a time cost its thread ~3 Python-to-C
    calls a row. (A matcher terminates only on accepting a stop token, so only those ask.)"""
    for s in states:
        s._settle()
    fed = [k for k, (s, t) in enumerate(zip(states, token_ids, strict=True)) if 0 <= t < s._vocab_size]
    accepted = [False] * len(states)
    if len(fed) == 1:
        accepted[fed[0]] = bool(states[fed[0]]._matcher.accept_token(int(token_ids[fed[0]])))
    elif fed:
        got = _xgr().BatchGrammarMatcher.batch_accept_token(
            [states[k]._matcher for k in fed], [int(token_ids[k]) for k in fed]
        )
        for k, ok in zip(fed, got, strict=True):
            accepted[k] = ok
    for s, t, ok in zip(states, token_ids, accepted, strict=True):
        if ok and t in s._stops:
            s._terminated = bool(s._matcher.is_terminated())
    return [(ok, s._terminated) for s, ok in zip(states, accepted, strict=True)]


_batch: Any = None  # one xgrammar BatchGrammarMatcher (its thread pool) per process, built on first use
_batch_lock = threading.Lock()
_fill_lock = threading.Lock()  # one batch fill at a time: the worker's, or the engine's own
_worker: ThreadPoolExecutor | None = None  # runs fills started ahead, one batch at a time
_last_fill: Future | None = None  # the newest fill started ahead (the worker runs them in order)


def _batch_matcher() -> Any:
    global _batch
    with _batch_lock:
        if _batch is None:
            # half the cores this process may use ("auto" counts the host's, beyond a container's share)
            _batch = _xgr().BatchGrammarMatcher(max_threads=max(1, len(os.sched_getaffinity(0)) // 2))
        return _batch


def _fill_rows(matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Each matcher's next mask into its row of bitmask: several on the batch matcher's threads."""
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        return
    batch = _batch_matcher()
    with _fill_lock:
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def _fill_ahead_rows(matchers: list, bitmask: torch.Tensor) -> list[Exception | None] | None:
    """The worker's job: row i of bitmask for matchers[i]. If the batch fails, each row alone, so
    that a failure is its own matcher's (None: all made)."""
    try:
        _fill_rows(matchers, bitmask, list(range(len(matchers))))
        return None
    except Exception:
        errors: list[Exception | None] = []
        for i, m in enumerate(matchers):
            try:
                m.fill_next_token_bitmask(bitmask, i)
                errors.append(None)
            except Exception as e:
                errors.append(e)
        return errors


def fill_bitmasks(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
    """bitmask[rows[k]] = the allowed next tokens of states[k]: the masks filled ahead copied (a
    batch's rows at once), the others filled now on several threads at once (inside a JSON string
    a fill costs ~0.15 ms, and a step waits for all of them)."""
    now: list[tuple[GrammarState, int]] = []
    batches: dict[int, tuple[Future, torch.Tensor, list[GrammarState], list[int], list[int]]] = {}
    for s, r in zip(states, rows, strict=True):
        if s._ahead is not None:  # grouped by the fill that made it: one wait a batch
            fill, made, at = s._ahead
            batch = batches.setdefault(id(fill), (fill, made, [], [], []))
            batch[2].append(s)
            batch[3].append(at)
            batch[4].append(r)
        elif s.is_terminated():
            bitmask[r].copy_(s._stop_row)
        else:
            now.append((s, r))
    words = bitmask.numpy()  # (numpy's row gather: torch's index ops cost the engine's thread ~10x as much)
    for fill, made, ahead, ats, rs in batches.values():
        errors = fill.result()
        if errors is not None:  # rows whose fill failed ahead are made now (raising here if they fail again)
            for s, at, r in zip(ahead, ats, rs, strict=True):
                if errors[at] is not None:
                    s._ahead = None
                    now.append((s, r))
            rs = [r for at, r in zip(ats, rs, strict=True) if errors[at] is None]
            ats = [at for at in ats if errors[at] is None]
        words[rs] = made.numpy()[ats]
    if now:
        _fill_rows([s._matcher for s, _ in now], bitmask, [r for _, r in now])


def fill_ahead(states: list[GrammarState]) -> None:
    """Start the next masks of these states on the grammar worker and return: the engine calls it
    when it has fed them their tokens (and a new sequence its first), and the sampling that needs
    the masks (a later step: such a row sits out while its mask is made) copies them. The fills
    release the interpreter lock, so the engine's thread goes on with other requests' work
    meanwhile. (When every running row is constrained, the masks are needed right after their
    tokens are fed, and the overlap is small.)"""
    global _worker, _last_fill
    live = [s for s in states if s._ahead is None and not s._terminated]
    if not live:
        return
    if _worker is None:
        with _batch_lock:
            _worker = _worker or ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
    made = allocate_bitmask(len(live), live[0]._vocab_size, fill=False)
    fill = _last_fill = _worker.submit(_fill_ahead_rows, [s._matcher for s in live], made)
    for r, s in enumerate(live):
        s._ahead = (fill, made, r)


def mask_logits(logits: torch.Tensor, states: list[GrammarState], rows: list[int]) -> None:
    """In place: logits[rows[k]] get -inf wherever states[k] forbids the next token (logits (N, V)
    fp32). On a GPU the rows' masks and indices travel in one pinned buffer and one kernel applies
    them (no bitmask of all N rows, no second copy); on the CPU xgrammar's kernel takes N rows."""
    if not logits.is_cuda:
        bitmask = allocate_bitmask(logits.shape[0], logits.shape[1], fill=False)
        fill_bitmasks(states, bitmask, rows)
        apply_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int32))
        return
    from chatengine.kernels.grammar_masks import apply_row_masks_triton, pack_row_masks

    packed, masks = pack_row_masks(rows, logits.shape[1], pin=True)
    fill_bitmasks(states, masks, list(range(len(rows))))
    with torch.cuda.device(logits.device):
        apply_row_masks_triton(logits, packed.to(logits.device, non_blocking=True), len(rows))


def fills_in_flight() -> bool:
    """A fill started ahead has not reported yet. Its xgrammar call runs without the interpreter
    lock, but the worker needs the lock back to report, and the engine's thread keeps it through its
    pure-Python bookkeeping: a mask made in time would still read as in the making at the next
    schedule, and its row would sit out a step more. The engine yields the lock once before
    scheduling while this is True."""
    return _last_fill is not None and not _last_fill.done()


def allocate_bitmask(rows: int, vocab_size: int, fill: bool = True) -> torch.Tensor:
    """A bitmask: int32 (rows, ceil(vocab_size / 32)) on CPU, all allowed (`fill`) or uninitialised
    (for rows that are all filled, or masked by row index)."""
    shape = (rows, (vocab_size + 31) // 32)
    if not fill:
        return torch.empty(shape, dtype=torch.int32)
    return torch.full(shape, -1, dtype=torch.int32)


def _check_shapes(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask needs logits (N, V) and an int32 bitmask (N, ceil(V/32))")
    n, v = logits.shape
    if bitmask.shape != (n, (v + 31) // 32):
        raise ValueError(f"bitmask shape {tuple(bitmask.shape)} does not fit logits {tuple(logits.shape)}")


# xgrammar's CPU kernel gives wrong masks and corrupts the heap for vocabularies below ~15 tokens
# (seen with 0.2.8); from one full 32-bit word up it matched the reference and wrote nothing past V
_MIN_CPU_KERNEL_VOCAB = 32


@torch.no_grad()
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits (N, V) float32 get -inf where bitmask (N, ceil(V/32)) int32 has a 0 bit
    (xgrammar's CPU kernel; the plain-torch reference elsewhere: a GPU step takes mask_logits'
    packed kernel). rows: int32 indices of the rows to mask, the other rows of both neither read
    nor changed (None: every row)."""
    _check_shapes(logits, bitmask)
    n, v = logits.shape
    if n == 0 or (rows is not None and rows.numel() == 0):
        return
    kernel = logits.dtype == torch.float32 and logits.stride(1) == 1 and logits.device.type == "cpu"
    if kernel and v >= _MIN_CPU_KERNEL_VOCAB:
        indices = None if rows is None else rows.tolist()
        # vocab_size given: bits past V (the last word's padding) are never read
        _xgr().apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=v, indices=indices, backend="cpu")
    else:
        apply_bitmask_ref(logits, bitmask, rows)


@torch.no_grad()
def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """apply_bitmask in plain torch: unpack the bits with shifts, then one masked fill."""
    _check_shapes(logits, bitmask)
    v = logits.shape[1]
    idx = None if rows is None else rows.to(device=logits.device, dtype=torch.long)
    words = bitmask.to(logits.device)
    words = words if idx is None else words[idx]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (R, W, 32): bit j of word w is token 32 * w + j
    allowed = bits.reshape(words.shape[0], -1)[:, :v].bool()
    if idx is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
