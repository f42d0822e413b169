"""Testing tools for front-ends built on ttflow (and for ttflow itself).

What a front-end author needs to property-test their code against ttflow, the way
`hypothesis.extra.numpy` and `xarray.testing.strategies` serve theirs:

- strategies for ttflow's values: `device_specs`, `dtypes`, `layouts`, `shapes`, `arrays`,
  `arrays_for`, and random valid programs: `program_cases`, `programs`, `binaries`;
- the numpy reference model: `stored` (what the device holds for a value stored in a dtype:
  exact for FLOAT32, BFLOAT16 and the integers, a proven error bound for BFLOAT8_B,
  `bfloat8_b_error_bound`), `ExpectedValue` (carried through programs with `map`, checked
  against `to_host` with `check`), and memory geometry (`storage_geometry`, `buffer_footprint`);
- `RuntimeStateMachine`, a hypothesis state machine over one device to subclass with your own
  programs (`ModelProgram`) and rules, with the `DeviceModel` tracker of every handle, `drain`
  and `hold_worker_threads`.

Needs hypothesis, a test dependency of ttflow: `pip install -e ".[test]"`. See docs/testing.md.
"""

try:
    import hypothesis as _hypothesis  # noqa: F401
except ImportError:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "ttflow.testing needs hypothesis, which ttflow installs only with its test extra: "
        'pip install -e ".[test]" in the ttflow checkout, or pip install hypothesis'
    ) from None

from ._machine import ModelProgram as ModelProgram
from ._machine import RuntimeStateMachine as RuntimeStateMachine
from ._machine_mesh import MeshStateMachine as MeshStateMachine
from ._model import DeviceModel as DeviceModel
from ._model import ModelTensor as ModelTensor
from ._model import QueueHold as QueueHold
from ._model import WorkerThreadHold as WorkerThreadHold
from ._model import drain as drain
from ._model import hold_worker_threads as hold_worker_threads
from ._reference import ExpectedValue as ExpectedValue
from ._reference import StorageGeometry as StorageGeometry
from ._reference import bfloat8_b_error_bound as bfloat8_b_error_bound
from ._reference import buffer_footprint as buffer_footprint
from ._reference import ordered_sums as ordered_sums
from ._reference import round_as as round_as
from ._reference import space_capacity as space_capacity
from ._reference import storage_geometry as storage_geometry
from ._reference import stored as stored
from ._strategies import FLOAT_MAGNITUDE as FLOAT_MAGNITUDE
from ._strategies import INT_RANGE as INT_RANGE
from ._strategies import ProgramCase as ProgramCase
from ._strategies import arrays as arrays
from ._strategies import arrays_for as arrays_for
from ._strategies import binaries as binaries
from ._strategies import device_specs as device_specs
from ._strategies import dtypes as dtypes
from ._strategies import layouts as layouts
from ._strategies import program_cases as program_cases
from ._strategies import programs as programs
from ._strategies import shapes as shapes

__all__ = [
    "RuntimeStateMachine", "MeshStateMachine", "ModelProgram", "DeviceModel", "ModelTensor", "QueueHold", "WorkerThreadHold",
    "drain", "hold_worker_threads",
    "ExpectedValue", "StorageGeometry", "bfloat8_b_error_bound", "buffer_footprint", "ordered_sums", "round_as",
    "space_capacity", "storage_geometry", "stored",
    "FLOAT_MAGNITUDE", "INT_RANGE", "ProgramCase", "arrays", "arrays_for", "binaries",
    "device_specs", "dtypes", "layouts", "program_cases", "programs", "shapes",
]
