"""The load test's short version (benchmarks/load_test.py --quick): simulated users with personas,
multi-turn histories, n=2 turns and hang-ups over the real HTTP API on loopback. No errors other
than the deliberate hang-ups, no KV block in use afterwards, a prefix-cache hit rate above 0."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent


def load_module():
    if "load_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("load_test", ROOT / "benchmarks" / "load_test.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["load_test"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["load_test"]


@pytest.mark.slow  # loads a whole server: left out of CI, run with the whole suite (README)
def test_quick_load_test(tmp_path):
    threads = torch.get_num_threads()
    try:
        report = load_module().run(["--quick", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    r, checks = report["results"], report["checks"]
    assert checks["passed"], checks["failures"]
    assert r["errors"] == 0, r["error_samples"]
    assert r["ok"] >= 5 and r["ok"] + r["hangups"] == r["requests"]
    assert r["hangups"] >= 1 and r["n2_requests"] >= 1, r  # the mix really happened
    assert checks["kv_blocks_used_after"] == 0 and checks["requests_left"] == 0
    assert r["hit_rate_engine"] > 0 and r["hit_rate_usage"] > 0
    assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p99"] >= r["itl_ms"]["p50"] > 0
    assert r["output_tokens"] > 0 and r["num_forks"] >= 1
    saved = json.loads(Path(report["saved"] + ".json").read_text())
    assert saved["results"] == r and saved["command"].startswith("python benchmarks/load_test.py --quick")
    assert set(saved["machine"]) >= {"platform", "cpu", "torch", "device"} and saved["commit"]
    assert "TTFT p50 / p99" in Path(report["saved"] + ".md").read_text()


def test_refuses_non_loopback_urls():
    module = load_module()
    for url in ("http://10.0.0.1:7860", "http://example.com", "http://0.0.0.0:7860"):
        with pytest.raises(SystemExit, match="loopback"):
            module.check_loopback(url)
    assert module.check_loopback("http://127.0.0.1:7860/") == "http://127.0.0.1:7860"
    assert module.check_loopback("http://[::1]:7860") == "http://[::1]:7860"
