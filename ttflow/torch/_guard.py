"""Builds and loads the C++ device guard that torch requires for the "tt" device.

torch refuses to create a tensor on a PrivateUse1 device without a `DeviceGuardImpl` and the
PrivateUse1 hooks, and both can only be registered from C++. `_guard.cpp` is short, but it
includes torch's ATen and autocast headers, so it takes 20-60 s to compile (23 s measured on an
idle 2-core machine, about 45 s beside other work); the shared library is cached per torch
version and source hash, so only the first import pays for it, and says so on stderr before the
compiler starts (`python -m ttflow.torch` builds it ahead, e.g. while building an image).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

__all__ = ["build", "cache_dir", "load_guard"]

_SOURCE = Path(__file__).with_name("_guard.cpp")
_loaded: ctypes.CDLL | None = None


def cache_dir() -> Path:
    """Where the built guard is kept: $TTFLOW_CACHE_DIR, else $XDG_CACHE_HOME/ttflow, else ~/.cache/ttflow."""
    explicit = os.environ.get("TTFLOW_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ttflow"


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _command(compiler: str, output: Path) -> list[str]:
    (lib,) = cpp_extension.library_paths()[:1]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [
        compiler, "-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes, str(_SOURCE), "-o", str(output),
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]


def _target() -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return cache_dir() / f"torch_guard-{torch.__version__}-{digest}.so"


def build(target: Path) -> None:
    """Compiles the guard into `target` (atomically: concurrent first imports never see half a file)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(
            "ttflow.torch needs a C++ compiler once, to build the small device guard torch "
            f"requires for the 'tt' device (cached in {target.parent}). Install one "
            "(e.g. `apt-get install g++`) or set CXX, then import ttflow.torch again."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run(_command(compiler, Path(tmp)), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(
            f"building ttflow.torch's device guard with {compiler} failed:\n{result.stderr[-4000:]}"
        )
    os.replace(tmp, target)


def _announce(target: Path) -> None:
    """One line on stderr before the build: a first import that is silent for most of a minute
    looks hung. stderr, not `warnings` (a `-W error` run would fail the import) nor logging
    (its default level hides INFO, so the silence would stay)."""
    print(f"ttflow.torch: compiling the tt device's C++ guard, once (20-60 s); cached in {target}",
          file=sys.stderr, flush=True)


def load_guard() -> Path:
    """Builds the guard if it is not cached yet, then loads it (once per process)."""
    global _loaded
    target = _target()
    if _loaded is None:
        if not target.exists():
            _announce(target)
            build(target)
        _loaded = ctypes.CDLL(str(target))
    return target
