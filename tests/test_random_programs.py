"""Random programs (ttflow.testing.program_cases): saved and loaded unchanged, and run on the
device as plain numpy says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ttflow as tt
from ttflow.testing import ProgramCase, binaries, program_cases


@settings(deadline=None)
@given(program_cases())
def test_random_programs_round_trip_and_run(tmp_path_factory: Any, case: ProgramCase) -> None:
    path = Path(tmp_path_factory.mktemp("bin")) / "p.ttb"
    tt.Binary([case.program]).save(path)
    (loaded,) = tt.Binary.load(path).programs
    assert loaded.same_as(case.program)

    async def run() -> list[np.ndarray]:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            tensors = [tt.to_device(x, device) for x in case.inputs]
            outs = tt.submit(device, tt.Binary([loaded]), 0, tensors)
            results = [await tt.to_host(o) for o in outs]
            for t in (*tensors, *outs):
                tt.deallocate(t)
            for space in tt.MemorySpace:
                assert device.memory_used(space) == 0
        return results

    case.check(anyio.run(run))


@settings(deadline=None, max_examples=10)
@given(binaries(max_programs=3), st.data())
def test_random_binaries_round_trip(tmp_path_factory: Any, binary: tt.Binary, data: st.DataObject) -> None:
    path = Path(tmp_path_factory.mktemp("bin")) / "b.ttb"
    binary.save(path)
    loaded = tt.Binary.load(path)
    assert len(loaded.programs) == len(binary.programs)
    for a, b in zip(loaded.programs, binary.programs):
        assert a.same_as(b)
    index = data.draw(st.integers(0, len(binary.programs) - 1))
    for i, spec in enumerate(binary.programs[index].inputs):
        assert tt.get_layout(loaded, index, i) == spec.layout
