"""The one error ttflow.torch adds to ttflow's hierarchy."""

from __future__ import annotations

import ttflow as tt

__all__ = ["UnsupportedOpError"]


class UnsupportedOpError(tt.ProgramError, NotImplementedError):
    """A torch op, module or dtype the tt device cannot run; the message names it.

    Raised at compile time for a module that uses it, or at once when an eager op is applied to a
    tt tensor. It is a `ttflow.ProgramError` and a `NotImplementedError`, so either catches it.
    """
