"""SamplingParams: the per-request knobs. temperature=0 means greedy."""

import math
from dataclasses import dataclass

MAX_STOP_TOKEN_IDS = 64  # each sampled token is checked against them


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

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
