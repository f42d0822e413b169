"""Tenstorrent's compiler's binaries on ttflow: tt-mlir's TTNN flatbuffers read, translated into
ttflow programs and run as compiled, and the system descriptor the compiler plans against.

A front-end beside `ttflow.torch`: it reads a file and emits builder calls and public runtime calls,
nothing below them (an import-linter contract says so).
"""

# `ttflow read`'s sections (ttrt read's names) and `ttflow run`'s input makers (ttrt run's --init),
# here so the command line's parser names them without importing the reader.
SECTIONS = ("version", "system_desc", "mlir", "programs", "inputs", "outputs", "ops")
INITS = ("randn", "arange", "zeros", "ones")

from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from .descriptor import SystemDesc as SystemDesc
    from .descriptor import system_desc as system_desc


def __getattr__(name: str) -> Any:
    """`system_desc` and `SystemDesc` imported when first read, so the command line's parser can
    name SECTIONS and INITS without importing numpy (tests/test_lazy_import.py)."""
    if name in ("SystemDesc", "system_desc"):
        import importlib

        module = importlib.import_module(".descriptor", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ttflow.ttnn' has no attribute {name!r}")


__all__ = ["INITS", "SECTIONS", "SystemDesc", "system_desc"]
