"""benchmarks/ttft_parts.py: a smoke run on the CPU (the parts of each TTFT add up to it; no timing)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import ttft_parts  # noqa: E402


def test_smoke_run_cuts_each_ttft_into_parts_that_add_up(tmp_path):
    argv = ["--model", "dummy:tiny", "--engine-options", '{"device": "cpu"}', "--quick", "--rates", "20"]
    argv += ["--requests", "6", "--personas", "1", "--persona-len", "40", "--cache", "on", "--out", str(tmp_path)]
    report = ttft_parts.main(argv)
    rows = report["parts"]["on"]["20.0"]
    assert set(rows) == set(ttft_parts.PARTS) and rows["ttft"]["n"] == 6
    assert sum(rows[p]["mean_ms"] for p in ttft_parts.PARTS[:-1]) == pytest.approx(rows["ttft"]["mean_ms"])
    assert all(rows[p]["p50_ms"] >= 0 for p in ttft_parts.PARTS)
    saved = json.loads(next(tmp_path.glob("ttft_parts-*.json")).read_text())
    assert saved["parts"] == json.loads(json.dumps(report["parts"]))
