"""examples/trace_replay.py measures what it says (issue 36): its two timed loops do the same work,
numpy's check of the results runs after both clocks stop, and the ratio it prints says "slower"
when the replay took longer.

The example runs with a fake clock whose readings the test chooses, so the figures it must print
follow from the readings alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import anyio
import pytest

import ttflow as tt

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 3


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trace_replay_example", ROOT / "examples" / "trace_replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("before, after", [(2.0, 1.0), (1.0, 3.0), (1.0, 1.0), (0.33, 1.0)])
def test_the_ratio_says_faster_or_slower(before: float, after: float) -> None:
    said = example().speedup(before, after)
    number, _, word = said.partition("x ")
    assert word == ("faster" if before >= after else "slower"), said
    assert float(number) == pytest.approx(max(before, after) / min(before, after), abs=0.005)


class Clock:
    """`time.perf_counter` for the example: the given readings, in order, and a log of when it
    was read and when numpy checked a result."""

    def __init__(self, readings: list[float]) -> None:
        self.readings = list(readings)
        self.log: list[str] = []

    def perf_counter(self) -> float:
        self.log.append("clock")
        return self.readings.pop(0)


def test_both_loops_do_the_same_work_and_the_check_comes_after(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = example()
    clock = Clock([0.0, 1.0, 10.0, 13.0])  # untraced 1 s in all, replayed 3 s: 3x slower
    original = module.reference

    def checking(*args: Any) -> Any:
        clock.log.append("check")
        return original(*args)

    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(module, "reference", checking)
    result = anyio.run(lambda: module.main(batches=BATCHES, d=64, spec=tt.DeviceSpec.small()))
    # Two timed loops, each between two clock readings, and no check inside either of them:
    # every result of both loops is checked once, after the second loop.
    assert clock.log == ["clock"] * 4 + ["check"] * (2 * BATCHES)
    assert result["untraced_s"] == pytest.approx(1.0 / BATCHES)
    assert result["replayed_s"] == pytest.approx(3.0 / BATCHES)
    assert result["max_error"] < 1e-4
    out = capsys.readouterr().out
    assert "(3.00x slower)" in out and "faster" not in out, out
