"""benchmarks/gpu_bench.py: its markdown from saved results (no GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu_bench  # noqa: E402

META = {
    "device": "NVIDIA H200",
    "commit": "abc1234",
    "date": "2026-11-28T11:18:56+00:00",
    "quick": False,
    "versions": {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "cuda": "13.0"},
}


def test_a_variant_is_shown_beside_the_default_with_its_ratio():
    run = {"requests": 256, "tok_s": 40000.0, "roofline": {"ceiling_tok_s": 70000.0}, "fraction_of_ceiling": 0.571}
    res = {"throughput": {"llama-3.2-1b": {**run, "variants": {'{"deterministic": true}': {"tok_s": 34000.0}}}}}
    md = gpu_bench.markdown(META, res)
    assert '| llama-3.2-1b | `{"deterministic": true}` | 40000 | 34000 | 0.850 |' in md.splitlines()
    assert "| llama-3.2-1b | 256 | 40000 | 70000 | 57% | - | - | - |" in md.splitlines()


def test_no_variant_table_without_variants():
    run = {"requests": 256, "tok_s": 40000.0}
    assert "variant / default" not in gpu_bench.markdown(META, {"throughput": {"qwen2.5-0.5b": run}})
