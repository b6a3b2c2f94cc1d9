"""benchmarks/api_bench.py: a smoke run of the API process against its stand-in replica (counts, no timing)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import api_bench  # noqa: E402


def test_smoke_run_streams_every_token_through_the_api(tmp_path):
    argv = ["--streams", "4", "--requests", "8", "--max-tokens", "6", "--step-ms", "2", "--rounds", "1"]
    report = api_bench.main([*argv, "--out", str(tmp_path)])
    (r,) = report["rounds"]
    assert (r["tokens"], r["errors"]) == (8 * 6, 0)  # from usage: every request's 6 tokens
    assert 8 <= r["chunks"] <= 8 * 6
    assert r["api_cpu_s_per_1k_tokens"] >= 0  # /proc counts 10 ms ticks: a run this short may read none
    saved = json.loads(next(tmp_path.glob("api_bench-*.json")).read_text())
    assert saved["median"]["tokens"] == 48 and saved["meta"]["streams"] == 4
