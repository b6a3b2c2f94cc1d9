"""ServedModels: the engines one server serves, by model id; the first is the default.

Each model has its own engine (its own KV pool and thread). The id is the engine's `model_id`:
what `/v1/models` lists, what API clients send as `model`, what a conversation remembers. A name
from a request is only ever looked up here (exact match): it never reaches the loader, so it can
name nothing on disk or on the Hub.

    models = ServedModels.of([engine_a, engine_b])   # or one engine
    models.default_id; models.ids; models[model_id]; models.items(); len(models)
    models.engine(None) -> the default engine; models.engine("x") -> UnknownModel naming the served ids
    models.shutdown()                               # every engine, even if one fails
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["ServedModels", "UnknownModel"]

log = logging.getLogger("chatengine.models")


class UnknownModel(ValueError):
    """A model id this server does not serve; the message names those it does."""


class ServedModels:
    def __init__(self, engines: Mapping[str, Any]):
        """engines: model id -> engine (AsyncLLM or LLM), in order; the first is the default."""
        if not engines:
            raise ValueError("a server needs at least one model")
        self._engines = dict(engines)
        self.default_id = next(iter(self._engines))

    @classmethod
    def of(cls, engines: Any) -> ServedModels:
        """ServedModels of one engine, of engines (each under its model_id; two with one id are
        refused), or as given."""
        if isinstance(engines, ServedModels):
            return engines
        if not isinstance(engines, Iterable):
            engines = [engines]
        by_id: dict[str, Any] = {}
        for engine in engines:
            model_id = str(engine.model_id)
            if model_id in by_id:
                raise ValueError(f"the model {model_id!r} is given twice: serve each model once")
            by_id[model_id] = engine
        return cls(by_id)

    @property
    def ids(self) -> list[str]:
        return list(self._engines)

    @property
    def default(self) -> Any:
        return self._engines[self.default_id]

    def resolve(self, model_id: str | None) -> str:
        """The served id that ``model_id`` names: None or "" is the default; anything else must be
        one of the ids, exactly."""
        if not model_id:
            return self.default_id
        if model_id not in self._engines:
            raise UnknownModel(f"the model {model_id!r} is not served here; choose one of: {', '.join(self.ids)}")
        return model_id

    def engine(self, model_id: str | None) -> Any:
        """The engine of ``model_id`` (see resolve)."""
        return self._engines[self.resolve(model_id)]

    def items(self):
        return self._engines.items()

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._engines

    def __getitem__(self, model_id: str) -> Any:
        return self._engines[model_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def shutdown(self) -> None:
        """Stop every engine (each flushes its KV store); one that fails is logged, the others still stop."""
        for model_id, engine in self._engines.items():
            try:
                engine.shutdown()
            except Exception:
                log.exception("the engine of %s failed to shut down", model_id)
