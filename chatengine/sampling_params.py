"""SamplingParams: the per-request knobs. temperature=0 means greedy.

The logits of a sampled row go through, in order: logit_bias, min_tokens (EOS and stop ids masked),
repetition / frequency / presence penalties, the structured-output mask, temperature; then top-k /
top-p and the draw. `logprobs` are taken after temperature (before top-k / top-p), so they describe
the distribution that was sampled; greedy rows report plain log-softmax. Prompt logprobs are the
model's raw log-softmax.
"""

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

MAX_STOP_TOKEN_IDS = 64  # each sampled token is checked against them
MAX_LOGPROBS = 20  # top candidates per token, as OpenAI allows
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows
# What one request may ask the grammar compiler for. Its time and memory grow faster than the text:
# a 30 KB grammar of optional literals compiles to ~30 MB, 230 KB to gigabytes; a JSON schema nested
# 400 deep takes seconds, 900 deep a minute. Well inside these, 0.2 s and tens of MB at most.
MAX_GRAMMAR_CHARS = 16 * 1024  # a grammar or a regex
MAX_SCHEMA_CHARS = 64 * 1024  # a JSON schema's text, and all the choices together
MAX_SCHEMA_DEPTH = 64  # objects and arrays inside one another in a JSON schema
MAX_CHOICES = 4096
_ROW_FLAG_INPUTS = frozenset(
    {"presence_penalty", "frequency_penalty", "repetition_penalty", "structured_outputs", "min_tokens", "logit_bias"}
)


@dataclass
class StructuredOutputs:
    """A constraint on the generated text; exactly one field set. Grammars compile once per spec
    (cached) and each sampled token is masked to those the grammar allows next."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF, with a `root` rule)

    def validate(self) -> None:
        set_fields = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_fields += ["json_object"] * bool(self.json_object)
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {set_fields or 'none'}"
            )
        if self.json is not None:
            _check_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None and len(value) > MAX_GRAMMAR_CHARS:
                raise ValueError(
                    f"structured_outputs.{name} has {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are allowed"
                )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES or sum(map(len, self.choice)) > MAX_SCHEMA_CHARS:
                raise ValueError(
                    f"structured_outputs.choice allows at most {MAX_CHOICES} choices of "
                    f"{MAX_SCHEMA_CHARS} characters together"
                )


def _check_schema(schema) -> None:
    """A JSON schema's kind, size and depth (see MAX_SCHEMA_*)."""
    if not isinstance(schema, (dict, str)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
    too_big = f"structured_outputs.json is too large: at most {MAX_SCHEMA_CHARS} characters of JSON are allowed"
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise ValueError(too_big)
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError:
            return  # not JSON: the compiler says what is wrong with it
        if not isinstance(schema, (dict, list)):
            return  # a bare number, string or null: the compiler says what is wrong with it
    else:
        try:  # (a cycle, or a nesting deep enough to exhaust the stack, cannot be a JSON schema)
            text = json.dumps(schema, default=str)
        except (ValueError, RecursionError):
            raise ValueError(
                "structured_outputs.json is not a JSON schema: it contains itself or nests too deep"
            ) from None
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(too_big)
    level = [schema]  # breadth first, one level of nesting at a time (no recursion to exhaust)
    for _ in range(MAX_SCHEMA_DEPTH):
        level = [v for node in level for v in (node.values() if isinstance(node, dict) else node)]
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            return
    raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: the top `logprobs` candidates and the sampled one
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (no prefix-cache hits)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    structured_outputs: StructuredOutputs | None = None
    if TYPE_CHECKING:  # set by _set_row_flags (plain attributes, not fields: no __init__ argument)
        penalized: bool = field(init=False)
        needs_history: bool = field(init=False)
        processed: bool = field(init=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        self._set_row_flags()

    def validate(self, max_n: int, max_tokens_limit: int, vocab_size: int | None = None) -> None:
        """Raise ValueError with an actionable message for values the engine cannot serve
        (vocab_size: the model's, which stop_token_ids must fall in)."""

        def number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= max_n:
            raise ValueError(f"n must be an integer in [1, {max_n}], got {self.n!r}")
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or not 1 <= self.max_tokens <= max_tokens_limit
        ):
            raise ValueError(f"max_tokens must be an integer in [1, {max_tokens_limit}], got {self.max_tokens!r}")
        number("temperature", self.temperature)
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100] (0 is greedy), got {self.temperature}")
        number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        stop = self.stop if isinstance(self.stop, list) else []  # a list since __post_init__
        if len(stop) > 16 or any(not isinstance(s, str) or not s or len(s) > 256 for s in stop):
            raise ValueError("stop must be at most 16 non-empty strings of at most 256 characters")
        self._validate_stop_token_ids(vocab_size)
        self._validate_processing(max_tokens_limit, vocab_size)

    def _validate_processing(self, max_tokens_limit: int, vocab_size: int | None) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        # logits are divided (or multiplied) by it in fp32, where a tiny one is 0 (inf, then NaN);
        # 0.01 already scales them 100-fold
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.01 <= r <= 10:
            raise ValueError(f"repetition_penalty must be a number in [0.01, 10] (1 disables it), got {r!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= min(self.max_tokens, max_tokens_limit):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {m!r}")
        self._validate_logit_bias(vocab_size)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError("structured_outputs must be a StructuredOutputs (or a dict of its fields)")
            self.structured_outputs.validate()

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries")
        top = vocab_size if vocab_size is not None else 2**63
        for t, b in bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < top:
                raise ValueError(f"logit_bias keys must be token ids in [0, {top}), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        top = vocab_size if vocab_size is not None else 2**63
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < top]
        if bad:
            where = f"in [0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else ">= 0"
            raise ValueError(f"stop_token_ids must be integers {where}; got {bad[:5]!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in _ROW_FLAG_INPUTS and "processed" in self.__dict__:  # changed after construction
            self._set_row_flags()

    def _set_row_flags(self) -> None:
        """The flags the step loop reads for every row and step, kept as plain attributes (three
        nested properties cost ~0.4 us a row a step):
          penalized      penalties read the tokens generated so far, so a step must know them
          needs_history  the next token's processing reads every token so far on the host
                         (penalties, a grammar, min_tokens' count)
          processed      anything beyond temperature / top-k / top-p touches this row's logits"""
        penalized = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        needs_history = penalized or self.structured_outputs is not None or self.min_tokens > 0
        d = self.__dict__
        d["penalized"], d["needs_history"] = penalized, needs_history
        d["processed"] = needs_history or bool(self.logit_bias) or self.min_tokens > 0
