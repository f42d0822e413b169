"""ttflow: device-resident tensors on an emulated tile-based AI accelerator."""

from ._errors import BinaryFormatError as BinaryFormatError
from ._errors import DeallocatedTensorError as DeallocatedTensorError
from ._errors import DeviceClosedError as DeviceClosedError
from ._errors import LayoutError as LayoutError
from ._errors import OutOfMemoryError as OutOfMemoryError
from ._errors import ProgramError as ProgramError
from ._errors import ShapeError as ShapeError
from ._errors import TTFlowError as TTFlowError
from ._memory import BufferInfo as BufferInfo
from ._types import DataType as DataType
from ._types import DeviceSpec as DeviceSpec
from ._types import Layout as Layout
from ._types import MemorySpace as MemorySpace
from ._types import TensorLayout as TensorLayout

__version__ = "0.1.0"
