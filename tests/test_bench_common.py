"""benchmarks/common.py's ThreadBusy: which thread of the API process or its engine paced a round."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ThreadBusy  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")


def test_a_spinning_engine_process_reads_busy_and_a_sleeping_main_idle():
    spin = "import time\nprint('spinning', flush=True)\nt = time.time()\nwhile time.time() - t < 5: pass"
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spinning"  # started: no guess at its start-up time
        busy = ThreadBusy((child.pid, child.pid))
        busy.mark()
        time.sleep(1.0)
        loads = busy.busy()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert set(loads) == {"api_main", "engine_main", "other_max"}
    assert 0.2 < loads["engine_main"] <= 1.05  # one core's worth at most
    assert loads["api_main"] < 0.2


def test_the_engine_thread_and_the_busiest_other_are_told_apart(monkeypatch):
    me = os.getpid()
    ticks = iter([
        {(me, me): 10, (me, 7): 0, (me, 8): 5, (4242, 4242): 0},  # at mark()
        {(me, me): 20, (me, 7): 80, (me, 8): 15, (4242, 4242): 30},  # a second later, at 100 ticks a second
    ])  # fmt: skip
    monkeypatch.setattr(ThreadBusy, "_ticks", lambda self: next(ticks))
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    busy = ThreadBusy((me, 7))
    busy._tick = 100
    busy.mark()
    assert busy.busy() == {"api_main": 0.1, "engine_main": 0.8, "other_max": 0.3}  # the child's 30 over 8's 10
