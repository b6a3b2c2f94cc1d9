"""The memory of several served models: one budget split into each model's share (--kv-memory-split).

Every model has its own engine, KV pool and tiers; the server's memory flags are the total of all of
them, and model k gets the fraction f_k of each:

- CPU device pool (kv_cache_gib), host tier (cpu_offload_gib), disk tier (kv_store_gib): f_k of each.
- CUDA: an engine sizes its pool from what the GPU has free when it starts, up to
  gpu_memory_utilization of the whole GPU (what earlier engines hold counts as used). So model k
  starts with the cumulative share gpu_memory_utilization x (f_1 + ... + f_k): its weights,
  activations and pages fill its f_k of the budget after the earlier models took theirs.

Without a split the shares are equal.

    fractions = parse_split("0.6,0.4", n_models)     # ValueError naming what is wrong
    options = split_options(engine_options, fractions) # one engine_options dict per model
"""

from __future__ import annotations

import dataclasses
import math

from chatengine import EngineConfig

__all__ = ["parse_split", "split_options"]

SPLIT_TIERS = ("kv_cache_gib", "cpu_offload_gib", "kv_store_gib")  # split by f_k
# the engine's own defaults: the total a model's share is cut from when a flag is not given
_DEFAULTS: dict[str, float] = {
    f.name: float(f.default)
    for f in dataclasses.fields(EngineConfig)
    if isinstance(f.default, int | float) and not isinstance(f.default, bool)
}


def parse_split(text: str | None, n: int) -> list[float]:
    """n fractions from "0.6,0.4" (each > 0, summing to 1 within 1e-6); None or "": equal shares."""
    if not text:
        return [1.0 / n] * n
    try:
        fractions = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--kv-memory-split takes fractions separated by commas, like 0.6,0.4; got {text!r}") from None
    if len(fractions) != n:
        raise ValueError(f"--kv-memory-split gives {len(fractions)} fractions for {n} models: give one per --model")
    if not all(math.isfinite(f) and f > 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"--kv-memory-split fractions must be > 0 and add up to 1; got {text!r}")
    return fractions


def split_options(engine_options: dict, fractions: list[float]) -> list[dict]:
    """Each model's engine options: the shared ones, with the memory budgets cut to its share.
    (One model: the options as given, so the engine's own defaults apply.)"""
    if len(fractions) == 1:
        return [dict(engine_options)]
    out, before = [], 0.0
    utilization = engine_options.get("gpu_memory_utilization") or _DEFAULTS["gpu_memory_utilization"]
    for f in fractions:
        options = dict(engine_options)
        for name in SPLIT_TIERS:
            options[name] = (engine_options.get(name) or _DEFAULTS[name]) * f
        before += f
        options["gpu_memory_utilization"] = min(utilization * before, 1.0)
        out.append(options)
    return out
