"""Warnings that point at the user's line, not at torch's or ttflow's frames between.

A fixed `stacklevel` cannot: an eager op reaches the fallback through torch's dispatcher, and
under `torch.compile` through dynamo's wrappers too, so the count of frames varies (a fixed
count named `torch/_dynamo/eval_frame.py` as the culprit). Python 3.12's `skip_file_prefixes`
does this; ttflow still runs on 3.11.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import ttflow

__all__ = ["warn_user", "warned"]

warned: set[str] = set()
"""What has warned once already: the ops the CPU fallback ran (`_fallback.warn_cpu`) and those a
compiled program hosts (`_lower.graph`); tests clear it to see a warning again."""

_LIBRARIES = tuple(os.path.dirname(module.__file__ or "") + os.sep for module in (torch, ttflow))


def _is_library(filename: str) -> bool:
    # "<eval_with_key>.N", "<string>": code torch generates (fx graphs, AOTAutograd's wrappers).
    return filename.startswith(_LIBRARIES) or filename.startswith("<")


def warn_user(message: str) -> None:
    """`warnings.warn(message, UserWarning)` attributed to the nearest frame outside torch and
    ttflow (the outermost frame when every frame is theirs, e.g. a thread of their own)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level + 1)
