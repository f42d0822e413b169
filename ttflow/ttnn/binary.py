"""`tt.Binary` from a tt-mlir `.ttnn` file: read (`reader`), then translated (`lower`).

`tt.Binary.load(path)` and `tt.Binary.from_bytes(data)` come here for a file whose flatbuffer
identifier is `TTNN`. Every program of the file becomes a ttflow program in the file's order
(`main` first, then its const-eval functions, which `main` also inlines where it calls them), so
`program_index` means what it means to tt-mlir's runtime and ttrt.
"""

from __future__ import annotations

import ttflow as tt

from .._errors import BinaryFormatError, ProgramError
from .._ir.binary import Binary
from .lower import lower_file
from .ops import READS, TRANSLATORS
from .plan import check_plan, chip_of
from .reader import read_ttnn

__all__ = ["read_binary"]


def read_binary(data: bytes, what: str = "the binary") -> Binary:
    """The programs of a TTNN flatbuffer. BinaryFormatError for a file ttflow cannot read (another
    schema hash, truncation, an offset out of range); ProgramError for an op it cannot run."""
    file = read_ttnn(data, what)
    chip = chip_of(file)
    for program in file.programs:  # the compiler's plan must fit the chip it was compiled for
        check_plan(file, program, chip)
    try:
        programs = lower_file(file, TRANSLATORS, READS)
        # tt.simplify drops what the translation leaves redundant (reshapes to the same shape,
        # casts to the same dtype, steps nothing reads: 11% of the corpus's steps).
        return Binary([tt.simplify(p) for p in programs])
    except ProgramError as exc:
        raise ProgramError(f"{what}: {exc}") from None
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, RecursionError) as exc:
        raise BinaryFormatError(f"{what} holds a malformed program: {type(exc).__name__}: {exc}") from exc
