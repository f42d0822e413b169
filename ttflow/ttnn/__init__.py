"""Tenstorrent's compiler's binaries on ttflow: tt-mlir's TTNN flatbuffers read, translated into
ttflow programs and run as compiled, and the system descriptor the compiler plans against.

A front-end beside `ttflow.torch`: it reads a file and emits builder calls and public runtime calls,
nothing below them (an import-linter contract says so).
"""

# `ttflow read`'s sections (ttrt read's names) and `ttflow run`'s input makers (ttrt run's --init),
# here so the command line's parser names them without importing the reader.
SECTIONS = ("version", "system_desc", "mlir", "programs", "inputs", "outputs", "ops")
INITS = ("randn", "arange", "zeros", "ones")

from .system_desc import SystemDesc as SystemDesc  # noqa: E402
from .system_desc import system_desc as system_desc  # noqa: E402

__all__ = ["INITS", "SECTIONS", "SystemDesc", "system_desc"]
