"""What every benchmark records about its run."""

import os
import subprocess
from pathlib import Path


def commit(override: str | None = None) -> str:
    """The commit a result belongs to: `override`, else $CHATENGINE_COMMIT (the GPU box gets the
    working tree, and its copy of .git may be missing or stale), else git's short sha (+ "-dirty"
    when tracked files differ from it), else "unknown"."""
    if override or os.environ.get("CHATENGINE_COMMIT"):
        return override or os.environ["CHATENGINE_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here
        ).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=here
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def freeze_heap() -> None:
    """What `chatengine serve` does once start-up is over (app/server.py): everything built so far
    (models, libraries) goes out of the cyclic collector's sight, so a full collection while serving
    walks only what serving makes. Benchmarks that drive the engine in their own process call it
    after loading, or a full collection over torch's and transformers' objects (~0.3-1 s on the CPU
    measured) lands inside their latency figures, which the server never shows."""
    import gc

    gc.collect()
    gc.freeze()
