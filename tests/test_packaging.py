"""Installing chatengine never shadows the PyPI package `kernels` (which transformers can use): our
Triton kernels install as chatengine.kernels, and both import side by side in one environment."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what pip says when it cannot reach the index (offline, no DNS, a proxy refusing): only then a skip
OFFLINE_SIGNS = (
    "from versions: none",
    "NewConnectionError",
    "ConnectionError",
    "Temporary failure in name resolution",
    "Max retries exceeded",
    "ProxyError",
    "timed out",
)


def test_no_top_level_kernels_package():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["chatengine*"]
    assert not (ROOT / "kernels").exists()
    assert (ROOT / "chatengine" / "kernels" / "paged_attention.py").exists()


@pytest.mark.slow
def test_ours_and_the_pypi_kernels_package_both_import(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check"]
    # --ignore-installed: a `kernels` in the system site-packages must not satisfy it (the venv sees them)
    theirs = subprocess.run(
        [*pip, "--ignore-installed", "--timeout", "20", "--retries", "1", "kernels"], capture_output=True, text=True
    )
    if theirs.returncode != 0:
        unreachable = any(s in theirs.stderr for s in OFFLINE_SIGNS)
        if not unreachable:
            pytest.fail(f"pip could not install `kernels`: {theirs.stderr.strip()[-600:]}")
        pytest.skip(f"the package index cannot be reached for `kernels`: {theirs.stderr.strip()[-300:]}")
    subprocess.run([*pip, "-e", str(ROOT)], check=True, capture_output=True)
    check = (
        "import kernels, chatengine.kernels.paged_attention as ours; "
        "print(kernels.__file__); print(ours.__file__); print(hasattr(kernels, 'get_kernel'))"
    )
    # run from tmp_path: the repo root on sys.path must not be what makes `chatengine` importable
    out = subprocess.run([python, "-c", check], capture_output=True, text=True, cwd=tmp_path, check=True)
    theirs_file, ours_file, has_api = out.stdout.split()
    assert Path(theirs_file).is_relative_to(venv), theirs_file
    assert Path(ours_file) == ROOT / "chatengine" / "kernels" / "paged_attention.py"
    assert has_api == "True"  # their API, not our module under their name
