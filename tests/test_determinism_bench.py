"""benchmarks/determinism_bench.py: its shards' result files and their merge (CPU, dummy:tiny)."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import determinism_bench  # noqa: E402


def test_every_shard_of_dotted_model_names_has_its_own_file(tmp_path):
    """A model's name has dots (llama-3.2-1b): no shard's results may overwrite another's."""
    stems = set()
    for model in ("dummy:llama-3.2-1b", "dummy:qwen2.5-0.5b"):
        for mode in ("default", "deterministic"):
            for k in range(4):
                args = argparse.Namespace(models=[model], modes=[mode], shard=f"{k}/4")
                stem = determinism_bench.result_stem(tmp_path, "cuda", "2026-11-28T07:00:00", "abc1234", args)
                stems.add(Path(stem + ".json").name)
    assert len(stems) == 16
    assert "determinism-cuda-2026-11-28-abc1234-llama-3.2-1b-default-shard0of4.json" in stems


def test_shards_add_up_to_every_target(tmp_path):
    """Two shards of each mode run to the end, then merged: every case counted over all targets."""
    common = ["--models", "dummy:tiny", "--prompts", "4", "--neighbours", "3", "--new-tokens", "3"]
    for mode in ("default", "deterministic"):
        for k in (0, 1):
            determinism_bench.main([*common, "--modes", mode, "--shard", f"{k}/2", "--out", str(tmp_path / "s")])
    files = sorted(str(f) for f in (tmp_path / "s").glob("*.json"))
    assert len(files) == 4
    determinism_bench.main(["--merge", *files, "--out", str(tmp_path / "m")])
    (merged,) = (tmp_path / "m").glob("*-merged.json")
    results = json.loads(merged.read_text())["results"]["dummy:tiny"]
    for mode in ("default", "deterministic"):
        for kind in ("greedy", "seeded"):
            assert sorted(results[mode][kind]) == list("bcdef")
            assert {c["targets"] for c in results[mode][kind].values()} == {4}
            assert results[mode][kind]["e"]["cached_tokens"] > 0  # restored from disk, not cold
    assert all(results["deterministic"][k][c]["tokens_differ"] == 0 for k in ("greedy", "seeded") for c in "bcdef")
