"""Tenstorrent's compiler, kept warm in a child process per system descriptor (`_server`).

The plugin's PJRT client is one per process and reads `TT_COMPILE_ONLY_SYSTEM_DESC` when it
starts, so the caller's JAX (a CPU JAX, see `_host`) and the compiler cannot share a process, and
each device or mesh ttflow runs on needs a compiler of its own: the descriptor ttflow writes for it
(`ttflow.ttnn.system_desc`). A compiler is started on first use and kept until `shutdown()` or the
interpreter's exit; the child also exits when its stdin closes, so no process outlives the caller.
Requests are one at a time per compiler (a lock), from any thread.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from .._errors import TTFlowError
from ._server import read_message, write_message

__all__ = ["CompileError", "Compiler", "compiler_for", "shutdown"]


class CompileError(TTFlowError):
    """Tenstorrent's compiler refused a function (its message follows), or its process died."""

_STDERR_TAIL = 4000


class Compiler:
    """One compiler process, started for one descriptor file."""

    def __init__(self, descriptor: bytes, label: str) -> None:
        self.label = label
        self._descriptor = descriptor
        self._folder = self._desc = self._log = Path()
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self.compiles = 0

    def _start(self) -> subprocess.Popen[bytes]:
        if self._folder != Path():  # a process that died: its folder goes with it
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = Path(tempfile.mkdtemp(prefix="ttflow-compiler-"))  # the process's own TMPDIR too
        self._desc = self._folder / "system_desc.ttsys"
        self._desc.write_bytes(self._descriptor)
        self._log = self._folder / "stderr.log"
        # TMPDIR of its own: the plugin copies the descriptor to `$TMPDIR/tt_pjrt_system_descriptor`
        # when it starts and reads it at each compile, one path for every process, so two compilers
        # sharing /tmp compile against whichever started last, and one that exits deletes the
        # other's (every later compile of the other fails)
        env = {**os.environ, "TT_COMPILE_ONLY_SYSTEM_DESC": str(self._desc), "TTFLOW_JAX_COMPILER_PROCESS": "1",
               "TMPDIR": str(self._folder)}
        env.pop("JAX_PLATFORMS", None)  # the plugin's platform must load there
        with open(self._log, "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "ttflow.jax._server"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, env=env)
        reply = self._receive(process)
        if reply[0] != "ready":
            self._stop(process)
            raise CompileError(f"the compiler for {self.label} did not start: {reply[1]}")
        return process

    def _receive(self, process: subprocess.Popen[bytes]) -> Any:
        assert process.stdout is not None
        reply = read_message(process.stdout)
        if reply is None:  # the process died: its exit status and what it printed last
            code = process.wait()
            tail = self._log.read_bytes()[-_STDERR_TAIL:].decode(errors="replace") if self._log.exists() else ""
            self._process = None
            raise CompileError(f"the compiler's process for {self.label} exited ({code}) while compiling:\n{tail}")
        return reply

    def compile(self, request: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        """The `.ttnn` bytes and the MLIR files of one exported function; CompileError with the
        compiler's own message when it refuses the function."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._process = self._start()
            stdin: IO[bytes] | None = self._process.stdin
            assert stdin is not None
            try:
                write_message(stdin, request)
            except BrokenPipeError:
                self._process = None
                raise CompileError(f"the compiler's process for {self.label} exited before the request") from None
            reply = self._receive(self._process)
            self.compiles += 1
        if reply[0] != "ok":
            raise CompileError(f"Tenstorrent's compiler ({self.label}) refused the function:\n{reply[1]}")
        return reply[1], reply[2]

    @staticmethod
    def _stop(process: subprocess.Popen[bytes]) -> None:
        if process.stdin is not None:
            process.stdin.close()  # the child's loop ends at EOF
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._stop(self._process)
                self._process = None
        if self._folder != Path():
            shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid


_compilers: dict[str, Compiler] = {}
_registry_lock = threading.Lock()


def compiler_for(descriptor: bytes, label: str) -> Compiler:
    """The warm compiler of this descriptor (the same bytes share one process)."""
    key = hashlib.sha256(descriptor).hexdigest()
    with _registry_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            compiler = _compilers[key] = Compiler(descriptor, label)
        return compiler


def shutdown() -> None:
    """Stops every compiler process (they start again on the next compile)."""
    with _registry_lock:
        compilers = list(_compilers.values())
        _compilers.clear()
    for compiler in compilers:
        compiler.close()


atexit.register(shutdown)
