"""What every benchmark records about its run."""

import json
import os
import subprocess
import sys
import time
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


def save_json(name: str, args, argv, body: dict, skip: tuple[str, ...] = ("out",)) -> tuple[dict, Path]:
    """Write {"meta": the run's commit, date, cores, command and options (args but `skip`), **body}
    to <args.out>/<name>-<date>-<commit>.json; returns (the report, its path)."""
    meta = {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu": f"{os.cpu_count()} cores",
        "command": f"python benchmarks/{name}.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **{k: v for k, v in vars(args).items() if k not in skip},
    }
    report = {"meta": meta, **body}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y-%m-%dT%H%M')}-{meta['commit']}.json"
    path.write_text(json.dumps(report, indent=1))
    return report, path
