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


class ThreadBusy:
    """How busy each thread of this process and of its children was between two marks (Linux
    /proc; elsewhere nothing): a closed loop runs as fast as its busiest thread, so this says which
    one paced a round: this process's main thread (the API's event loop), the engine's loop
    (`engine`: (pid, tid), a replica process's main thread or a thread here), or another."""

    def __init__(self, engine: tuple[int, int]) -> None:
        self._engine = engine
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start: dict[tuple[int, int], int] = {}
        self._t0 = 0.0

    def mark(self) -> None:
        self._start, self._t0 = self._ticks(), time.perf_counter()

    def busy(self) -> dict[str, float]:
        """Since mark(): {"api_main", "engine_main", "other_max"} as fractions of the wall time
        ("other_max": the busiest thread besides those two). Empty without /proc."""
        wall = (time.perf_counter() - self._t0) * self._tick
        now = self._ticks()
        if not now or wall <= 0:
            return {}
        used = {key: (t - self._start.get(key, 0)) / wall for key, t in now.items()}
        me = os.getpid()
        api, engine = used.pop((me, me), 0.0), used.pop(self._engine, 0.0)
        return {
            "api_main": round(api, 3),
            "engine_main": round(engine, 3),
            "other_max": round(max(used.values(), default=0.0), 3),
        }

    def _ticks(self) -> dict[tuple[int, int], int]:
        """{(pid, tid): utime + stime ticks} of this process's threads, the engine's process's and
        any other child's (a thread that ends meanwhile is left out)."""
        me = os.getpid()
        out = {}
        for pid in dict.fromkeys([me, self._engine[0], *_children(me)]):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
                if fields:
                    out[pid, int(tid)] = int(fields[11]) + int(fields[12])
        return out


def _children(pid: int) -> list[int]:
    """The child processes of any of pid's threads (/proc/<pid>/task/<tid>/children; none where the
    kernel lacks those lists)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += map(int, f.read().split())
        except OSError:
            continue
    return kids


def stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc stat line after the command's name (which may hold spaces): [0] is
    the state, [1] the parent's pid, [11] / [12] utime / stime."""
    try:
        with open(path) as f:
            line = f.read()
    except OSError:
        return None
    return line[line.rfind(")") + 2 :].split()
