"""A worker keeps its freed heap (`_workers.heap.keep_freed_heap`): checked by the page faults of a
loop of large temporaries on a thread of a fresh interpreter, with and without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ttflow._workers.heap import keep_freed_heap

_LOOP = """
import resource, sys, threading
import numpy as np
from ttflow._workers.heap import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
x = (np.random.default_rng(0).standard_normal((128, 1024)) / 8).astype(np.float32)
def op():  # an op computed in float64 by ranges, as numpy code is: 1 MiB temporaries and masked
    x64 = x.astype(np.float64)  # parts of varying sizes, made and freed
    y = np.abs(x64)
    out = np.full_like(y, np.nan)
    for low, high in ((0.0, 0.05), (0.05, 0.2), (0.2, np.inf)):
        mask = (y > low) & (y <= high)
        v = y[mask]
        out[mask] = np.exp(-v * v) * v
    return np.copysign(out, x64).astype(np.float32)
def loop():  # on a thread of its own, as a worker's records run (its own malloc arena)
    for _ in range(3):  # the heap grows
        op()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        op()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=loop)
thread.start()
thread.join()
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], env=env, capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


@glibc
def test_a_kept_heap_stops_the_page_faults_of_each_temporary() -> None:
    kept, default = _faults("keep"), _faults("default")
    # Without it a temporary's pages fault again each time glibc hands them back to the kernel
    # (measured: 10,520 faults in the 20 calls); with it, none after the heap grew.
    assert default > 20 * 256
    assert kept < 20 * 16


def test_the_users_malloc_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert keep_freed_heap() is False
