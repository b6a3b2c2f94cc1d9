"""benchmarks/serve_bench.py: its workload and a smoke run through AsyncLLM (a report, no timing)."""

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import serve_bench as sb  # noqa: E402


def test_arrivals_have_the_asked_mean_rate():
    for kind in ("poisson", "bursty"):
        t = sb.arrival_times(4000, 20.0, kind, random.Random(1))
        gaps = [b - a for a, b in zip([0.0, *t], t)]
        assert abs(statistics.mean(gaps) - 0.05) < 0.005, kind
    bursty = sb.arrival_times(4000, 20.0, "bursty", random.Random(1))
    poisson = sb.arrival_times(4000, 20.0, "poisson", random.Random(1))
    spread = [statistics.stdev(b - a for a, b in zip(t, t[1:])) for t in (bursty, poisson)]
    assert spread[0] > 1.5 * spread[1]  # bursty: the same mean, more uneven


def test_a_session_resends_its_growing_history():
    w = sb.Workload(vocab=500, personas=2, persona_len=20, seed=0, quick=True)
    s = w.session()
    first, n1 = s.next_prompt()
    second, _ = s.next_prompt()
    assert first[:20] in w.personas and second[: len(first)] == first
    assert second[len(first) : len(first) + n1] == s.replies[0]  # the reply of its own length, then the message
    assert len(second) == len(first) + n1 + len(s.users[1])
    while not s.done:
        s.next_prompt()
    assert s.turn == len(s.users)


def test_smoke_run_reports_hits_only_with_the_cache(tmp_path):
    report = sb.main(
        [
            "--model",
            "dummy:tiny",
            "--targets",
            "async",
            "--rates",
            "30",
            "--requests",
            "10",
            "--quick",
            "--personas",
            "1",
            "--persona-len",
            "48",
            "--engine-options",
            '{"device": "cpu", "num_kv_blocks": 128}',
            "--out",
            str(tmp_path),
        ]
    )
    on, off = report["results"]["async/on"]["rates"]["30.0"], report["results"]["async/off"]["rates"]["30.0"]
    assert on["errors"] == off["errors"] == 0 and on["requests"] == 10
    assert on["prefix_hit_rate"] > 0.3 and off["prefix_hit_rate"] == 0
    assert on["ttft_p50_ms"] > 0 and on["output_tok_s"] > 0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md", ".png"]
