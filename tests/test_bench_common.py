"""benchmarks/common.py's ThreadBusy: which thread of the API process or its engine paced a round."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ThreadBusy  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_spinning_engine_process_reads_busy_and_a_sleeping_main_idle():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)  # the child's start-up
        busy = ThreadBusy((child.pid, child.pid))
        busy.mark()
        time.sleep(0.6)
        loads = busy.busy()
    finally:
        child.kill()
        child.wait()
    assert set(loads) == {"api_main", "engine_main", "other_max"}
    assert 0.2 < loads["engine_main"] <= 1.05  # one core's worth at most
    assert loads["api_main"] < 0.2


def test_an_engine_thread_here_is_told_from_the_other_threads():
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), _spin(0.8)))
    idle = threading.Thread(target=stop.wait)
    idle.start()
    worker.start()
    started.wait()
    busy = ThreadBusy((os.getpid(), worker.native_id))
    busy.mark()
    time.sleep(0.5)
    loads = busy.busy()
    worker.join()
    stop.set()
    idle.join()
    assert loads["engine_main"] > 0.2
    assert loads["other_max"] < 0.2  # the idle thread
