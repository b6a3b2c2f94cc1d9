"""benchmarks/flush_bench.py: every page is left to the flush, and every setting writes them all."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import flush_bench  # noqa: E402
from chatengine.engine.kv import transfers  # noqa: E402


def test_a_small_run_flushes_every_page_in_every_setting(tmp_path, monkeypatch):
    monkeypatch.setattr(transfers, "FLUSH_HELPERS", transfers.FLUSH_HELPERS)  # the bench sets it per row
    argv = ["--prompts", "4", "--prompt-len", "64", "--kv-blocks", "64", "--repeats", "1"]
    argv += ["--busy-threads", "0", "1", "--helpers", "0", "2", "--dir", str(tmp_path), "--out", str(tmp_path / "out")]
    report = flush_bench.main(argv)
    rows = report["rows"]
    assert [(r["busy_threads"], r["helpers"]) for r in rows] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert {r["pages"] for r in rows} == {4 * 64 // 16}  # every full block of every prompt, each time
    assert all(r["seconds"] > 0 for r in rows)
    [saved] = (tmp_path / "out").glob("flush_bench-*.json")
    assert json.loads(saved.read_text())["rows"] == rows
    assert not list(tmp_path.glob("flush-bench-*"))  # the stores are removed
