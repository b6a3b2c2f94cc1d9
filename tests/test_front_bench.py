"""benchmarks/front_bench.py: a smoke run of DataParallelLLM's API process against stand-in replicas
(counts, no timing)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import front_bench  # noqa: E402


def test_smoke_run_relays_whole_answers_and_routes_next_turns_by_affinity(tmp_path):
    argv = ["--replicas", "2", "--users", "4", "--seconds", "2", "--step-ms", "1", "--out", str(tmp_path)]
    report = front_bench.main(argv)
    assert report["tokens"] > 0 and report["tokens"] % front_bench.ANSWER == 0  # whole answers only
    router = report["router"]
    assert router["least_loaded"] >= 4 and router["affinity"] >= 1  # next turns go where the history is
    saved = json.loads(next(tmp_path.glob("front_bench-*.json")).read_text())
    assert saved["tokens"] == report["tokens"] and saved["meta"]["replicas"] == 2
