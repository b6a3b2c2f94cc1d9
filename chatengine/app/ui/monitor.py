"""EngineMonitor: samples the engine's stats once a second for the Engine tab's plots."""

import asyncio
import logging
import time
from collections import deque

log = logging.getLogger("chatengine.ui")
HISTORY_POINTS = 600  # engine samples kept for the plots (1 per second: 10 minutes)


class EngineMonitor:
    """Samples engine.stats() once a second (while the server runs) for the plots."""

    def __init__(self, engine, interval: float = 1.0):
        self.engine, self.interval = engine, interval
        self.samples: deque = deque(maxlen=HISTORY_POINTS)
        self.t0 = time.time()
        self._task: asyncio.Task | None = None
        self._prev: tuple[float, dict] | None = None

    def stats(self) -> dict:
        for _ in range(3):  # stats() reads engine structures that its thread may be changing
            try:
                return self.engine.stats()
            except RuntimeError:
                time.sleep(0.001)
        return {}

    def sample(self) -> dict:
        st = self.stats()
        now = time.time()
        point = {
            "t": now,
            "hit_rate": 100 * float(st.get("prefix_cache_hit_rate") or 0),
            "tok_s": 0.0,
            "window_hit": None,
        }
        if self._prev is not None:
            pt, pst = self._prev
            dt = max(now - pt, 1e-6)
            point["tok_s"] = max(0, st.get("num_generated_tokens", 0) - pst.get("num_generated_tokens", 0)) / dt
            dq = st.get("prefix_cache_queried_tokens", 0) - pst.get("prefix_cache_queried_tokens", 0)
            if dq > 0:
                point["window_hit"] = (
                    100 * (st.get("prefix_cache_hit_tokens", 0) - pst.get("prefix_cache_hit_tokens", 0)) / dq
                )
        self._prev = (now, st)
        self.samples.append(point)
        return st

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._run())
            except RuntimeError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # never let the sampler die on a transient error
                log.exception("engine stats sample failed")
            await asyncio.sleep(self.interval)

    def frames(self):
        import pandas as pd

        pts = list(self.samples)
        now = time.time()
        hit = [{"t": round(p["t"] - now, 1), "value": p["hit_rate"], "series": "since start"} for p in pts]
        hit += [
            {"t": round(p["t"] - now, 1), "value": p["window_hit"], "series": "per second"}
            for p in pts
            if p["window_hit"] is not None
        ]
        thr = [{"t": round(p["t"] - now, 1), "value": round(p["tok_s"], 2)} for p in pts]
        hit_df = pd.DataFrame(hit, columns=["t", "value", "series"]).astype({"t": float, "value": float})
        thr_df = pd.DataFrame(thr, columns=["t", "value"]).astype({"t": float, "value": float})
        return hit_df, thr_df
