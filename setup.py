"""Builds the Cython kernels; everything else is declared in pyproject.toml."""

from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

KERNELS = Path("ttflow") / "_kernels"

extensions = [
    Extension(
        f"ttflow._kernels.{pyx.stem}",
        [str(pyx)],
        include_dirs=[np.get_include(), str(KERNELS)],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")],
        extra_compile_args=["-O3", "-fno-strict-aliasing"],
    )
    for pyx in sorted(KERNELS.glob("*.pyx"))
] + [
    # The allocator of bank memory (below `ttflow._memory.banks`), on dispatch's hot path.
    Extension(
        "ttflow._core._allocator",
        [str(Path("ttflow") / "_core" / "_allocator.pyx")],
        extra_compile_args=["-O3"],
    ),
    # Scheduling state's records and a tiny program's submit and run: dispatch's hot path.
    Extension(
        "ttflow._core._dispatch",
        [str(Path("ttflow") / "_core" / "_dispatch.pyx")],
        extra_compile_args=["-O3"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "initializedcheck": False,
            "cdivision": True,
            "embedsignature": True,
        },
    )
)
