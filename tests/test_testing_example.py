"""The worked example of docs/testing.md: a tiny front-end tested with ttflow.testing.

Every code block of the page is a verbatim excerpt of this file (checked below), so the page
shows code that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import ttflow as tt
from ttflow.testing import (
    ExpectedValue,
    ModelProgram,
    RuntimeStateMachine,
    arrays_for,
    layouts,
    stored,
)

# --- the front-end: trace a numpy expression into a ttflow program ---


class Traced:
    """A value being traced: arithmetic on it adds ops to the program being built."""

    def __init__(self, builder: tt.ProgramBuilder, value: Any) -> None:
        self.builder, self.value = builder, value

    def _op(self, name: str, other: Any) -> Traced:
        operand = other.value if isinstance(other, Traced) else float(other)
        return Traced(self.builder, getattr(self.builder, name)(self.value, operand))

    def __add__(self, other: Any) -> Traced:
        return self._op("add", other)

    def __mul__(self, other: Any) -> Traced:
        return self._op("mul", other)

    __radd__, __rmul__ = __add__, __mul__


def relu(x: Any) -> Any:
    """ReLU on numpy arrays and on traced values alike."""
    if isinstance(x, Traced):
        return Traced(x.builder, x.builder.relu(x.value))
    return np.maximum(x, np.float32(0))


def compile_expression(fn: Callable[[Any], Any], shape: tuple[int, ...],
                       output: tt.Layout = tt.Layout()) -> tt.Binary:
    """Traces `fn` into a one-program binary: any float input, computed in float32."""
    b = tt.ProgramBuilder(fn.__name__)
    x = Traced(b, b.input(shape, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE,
                                           tt.DataType.FLOAT32)))
    b.output(fn(x).value, output)
    return tt.Binary([b.build()])


def scale_shift(x: Any) -> Any:
    return relu(x * 0.5 + 1.0) + x * 0.25


# --- a property test of the front-end ---

FLOATS = [tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B]


@settings(deadline=None, max_examples=20)
@given(st.data())
def test_compiled_expression_matches_numpy(data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from([(5, 7), (40, 33), (2, 64, 32)]))
    source = data.draw(layouts(data.draw(st.sampled_from(FLOATS))))  # where the input lives
    output = data.draw(layouts(data.draw(st.sampled_from(FLOATS))))  # what the program makes
    array = data.draw(arrays_for(source, shape))
    binary = compile_expression(scale_shift, shape, output)

    async def run() -> np.ndarray:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            x = tt.to_device(array, device, source)
            (y,) = tt.submit(device, binary, 0, [x])
            return await tt.to_host(y)

    got = anyio.run(run)
    # What the device holds for the input, converted to the program's float32, through the
    # expression (evaluated by numpy at both ends of each interval), stored as the output.
    expected = (stored(array, source.dtype)  # type: ignore[arg-type]
                .stored_as(tt.DataType.FLOAT32)
                .map(scale_shift)
                .stored_as(output.dtype))  # type: ignore[arg-type]
    expected.check(got)


# --- the front-end's programs in the runtime state machine, plus one rule of its own ---


def reference(x: ExpectedValue) -> list[ExpectedValue]:
    return [x.map(scale_shift)]


class FrontendMachine(RuntimeStateMachine):
    shapes = ((40, 33),)
    programs = [ModelProgram(compile_expression(scale_shift, (40, 33)), reference)]

    @precondition(lambda self: self.has(lambda e: e.usable and e.dtype.is_float))
    @rule(data=st.data())
    def rerun_on_its_own_output(self, data: st.DataObject) -> None:
        """The front-end feeds a result straight back in, without a trip to the host."""
        entry = self.pick(data, lambda e: e.usable and e.dtype.is_float)
        (out,) = self.run_program(self.programs[0], [entry])
        for _ in range(data.draw(st.integers(1, 3), label="again")):
            (out,) = self.run_program(self.programs[0], [out])


TestFrontendMachine = FrontendMachine.TestCase
TestFrontendMachine.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)


# --- the page shows this file ---


def test_docs_testing_page_shows_this_file() -> None:
    import re
    from pathlib import Path

    page = Path(__file__).parent.parent / "docs" / "testing.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks, "docs/testing.md has no python blocks"
    source = Path(__file__).read_text()
    for block in blocks:
        assert block in source, f"docs/testing.md shows code that is not in {__file__}:\n{block}"
