"""Every file ttflow's API reads or writes fails with a `tt.FileError` (issue 36): a ttflow error
that is also an `OSError`, naming the path, with the system's errno and its error as the cause.

The reference for each case is what the operating system itself says about the path (its
errno, from a plain `open` of the same path), not ttflow's own message."""

from __future__ import annotations

import errno
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow._ir import binary as _binary
from ttflow._observe.memory_map import MemoryMapRecorder

SMALL = tt.DeviceSpec.small()


def a_binary() -> tt.Binary:
    b = tt.ProgramBuilder("relu")
    b.output(b.relu(b.input((32, 32))))
    return tt.Binary([b.build()])


def os_errno(path: Path, mode: str) -> int:
    """What the system says when `path` is opened with `mode`: the independent reference."""
    try:
        with open(path, mode):
            pass
    except OSError as exc:
        assert exc.errno is not None
        return exc.errno
    raise AssertionError(f"{path} opens with {mode!r}: not a failing case")


def check(raised: pytest.ExceptionInfo[BaseException], path: Path, mode: str, says: str) -> None:
    error = raised.value
    assert isinstance(error, tt.FileError) and isinstance(error, tt.TTFlowError) and isinstance(error, OSError)
    assert error.errno == os_errno(path, mode), (error.errno, os_errno(path, mode))
    assert error.filename == os.fspath(path) and repr(os.fspath(path)) in str(error)
    assert says in str(error), str(error)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == error.errno


def failing_paths(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Paths no file can be written to, and what the message says of each."""
    (tmp_path / "a_file").write_text("")
    return {
        "folder": (tmp_path, "is a folder"),
        "missing folder": (tmp_path / "not" / "there" / "out.bin", "does not exist"),
        "a file as a folder": (tmp_path / "a_file" / "out.bin", "not a folder"),
    }


@pytest.mark.parametrize("case", ["folder", "missing folder", "a file as a folder"])
def test_binary_save_where_no_file_can_be(case: str, tmp_path: Path) -> None:
    path, says = failing_paths(tmp_path)[case]
    with pytest.raises(tt.FileError) as raised:
        a_binary().save(path)
    check(raised, path, "wb", says)
    assert "save the binary" in str(raised.value)


def test_binary_save_onto_a_folder_suggests_a_file_name(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="is a folder") as raised:  # `except OSError` still catches it
        a_binary().save(tmp_path)
    assert repr(os.fspath(tmp_path / "model.ttb")) in str(raised.value)


@pytest.mark.parametrize("case", ["folder", "missing", "a file as a folder"])
def test_binary_load_of_what_is_not_a_file(case: str, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    path, says = {"folder": (tmp_path, "is a folder"), "missing": (tmp_path / "none.ttb", "no such file"),
                  "a file as a folder": (tmp_path / "a_file" / "m.ttb", "not a folder")}[case]
    with pytest.raises(tt.FileError) as raised:
        tt.Binary.load(path)
    check(raised, path, "rb", says)
    assert "load a binary" in str(raised.value)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads a file of mode 000")
def test_binary_load_of_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "locked.ttb"
    a_binary().save(path)
    path.chmod(0)
    try:
        with pytest.raises(tt.FileError) as raised:
            tt.Binary.load(path)
        check(raised, path, "rb", "permission denied")
    finally:
        path.chmod(0o600)


def denied(path: Any, *args: Any, **kwargs: Any) -> Any:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))


def test_permission_denied_is_a_file_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root (this sandbox) no mode makes a file unreadable: the system's refusal is planted."""
    path = tmp_path / "m.ttb"
    a_binary().save(path)
    monkeypatch.setattr(_binary, "open", denied, raising=False)
    for call in (lambda: tt.Binary.load(path), lambda: a_binary().save(path)):
        with pytest.raises(tt.FileError, match="permission denied") as raised:
            call()
        assert raised.value.errno == errno.EACCES and raised.value.filename == os.fspath(path)


def test_a_file_error_pickles_and_copies() -> None:
    """Errors cross to and from worker processes, and a stored error is raised as a copy."""
    import copy

    error = tt.FileError("cannot load a binary from 'x': no such file", "x", errno.ENOENT, "No such file")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(again) is tt.FileError and str(again) == str(error)
        assert (again.errno, again.strerror, again.filename) == (errno.ENOENT, "No such file", "x")


async def recorded_run() -> tuple[tt.TimelineRecorder, MemoryMapRecorder]:
    async with tt.open_device(SMALL) as device:
        with tt.record_timeline(device) as timeline, tt.record_memory_map(device) as memory_map:
            await tt.to_host(tt.to_device(np.ones((32, 32), np.float32), device))
    return timeline, memory_map


@pytest.fixture(scope="module")
def recorders() -> tuple[tt.TimelineRecorder, MemoryMapRecorder]:
    return anyio.run(recorded_run)


@pytest.mark.parametrize("case", ["folder", "missing folder", "a file as a folder"])
def test_timeline_save_where_no_file_can_be(case: str, tmp_path: Path, recorders: Any) -> None:
    path, says = failing_paths(tmp_path)[case]
    with pytest.raises(tt.FileError) as raised:
        recorders[0].save(path)
    check(raised, path, "w", says)
    assert "write the timeline" in str(raised.value)
    good = tmp_path / "trace.json"
    recorders[0].save(good)
    assert json.loads(good.read_text())["traceEvents"]


@pytest.mark.parametrize("case", ["folder", "missing folder", "a file as a folder"])
def test_memory_map_where_no_file_can_be(case: str, tmp_path: Path, recorders: Any) -> None:
    pytest.importorskip("matplotlib")
    path, says = failing_paths(tmp_path)[case]
    with pytest.raises(tt.FileError) as raised:
        tt.draw_memory_map(recorders[1], path)
    check(raised, path, "wb", says)
    assert "write the memory map" in str(raised.value)


def saves(recorders: Any) -> dict[str, Callable[[Path], object]]:
    return {"binary": a_binary().save, "timeline": recorders[0].save,
            "memory map": lambda p: tt.draw_memory_map(recorders[1], p)}


def test_every_save_writes_a_good_path(tmp_path: Path, recorders: Any) -> None:
    pytest.importorskip("matplotlib")
    for name, save in saves(recorders).items():
        path = tmp_path / name.replace(" ", "_")
        save(path)
        assert path.stat().st_size > 0, name
