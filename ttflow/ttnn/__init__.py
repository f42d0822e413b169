"""Tenstorrent's compiler's binaries on ttflow: tt-mlir's TTNN flatbuffers read, translated into
ttflow programs and run as compiled, and the system descriptor the compiler plans against.

A front-end beside `ttflow.torch`: it reads a file and emits builder calls and public runtime calls,
nothing below them (an import-linter contract says so).
"""
