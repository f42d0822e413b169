from typing import Any

def renew_plan_token() -> None: ...
def bind(storage_type: type, state_type: type, program_type: type, tensor_type: type,
         binary_type: type, no_deps: list[Any], kernel_run: Any, l1: Any) -> None: ...

class StorageCore:
    layout: Any
    address: int
    page_size: int
    aligned_page_size: int
    num_pages: int
    dims3: tuple[int, int, int]
    nbytes: int
    pages: Any
    _buffer: Any
    flights: list[Any] | None
    def __init__(self, layout: Any, address: int, page_size: int, aligned_page_size: int,
                 num_pages: int, dims3: tuple[int, int, int]) -> None: ...

class CommandCore:
    queue: Any
    deps: list[Any]
    done: bool
    error: BaseException | None
    _event: Any
    started: float
    record: Any
    capture: Any
    scheduler: Any
    reads: tuple[Any, ...]
    writes: tuple[Any, ...]
    program: Any
    plan: Any
    converted: list[Any]
    sent: Any
    footprint: int
    spill: bool
    peers: Any

class StateCore:
    shape: tuple[int, ...]
    dtype: Any
    declared: Any
    storages: list[Any]
    last_writer: Any
    last_reader: Any
    pending: int
    error: BaseException | None
    deallocated: bool
    moving: Any
    donated_to: str | None
    name: str | None
    unretained: bool
    def __init__(self, shape: tuple[int, ...], dtype: Any, layout: Any) -> None: ...

class TensorCore:
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> Any: ...
    @property
    def device(self) -> Any: ...
    @property
    def _state(self) -> Any: ...

def wrap(cls: type, device: Any, state: StateCore) -> Any: ...

class QueueCore:
    _pending: Any
    _append: Any
    _wakeup: Any
    _closing: bool

class MeshTensorCore:
    _mesh: Any
    _chips: tuple[Any, ...]
    _states: tuple[Any, ...]
    _handles: tuple[Any, ...] | None
    _placement: Any
    _shape: tuple[int, ...]
    _grid: Any

class SchedulerCore:
    _spaces: dict[Any, Any]
    counters: Any
    _owned: dict[Any, Any]
    _l1: dict[Any, Any]
    _pins: dict[Any, int]
    _orphans: dict[Any, None]
    capturing: Any
    _dropped: Any
    listeners: list[Any]
    _last_plan: Any
    cq0: Any
    cq1: Any
    l1_allocator: Any
    evict_eagerly: bool
    cb_depth: int
    _free_on_landing: set[Any]
    plan_hits: int
    plan_misses: int
    plans_uncached: bool
    def allocate_geometry(self, geometry: tuple[Any, ...], owner: Any) -> Any: ...
    def add_storage(self, state: Any, storage: Any) -> None: ...
    def free(self, storage: Any) -> None: ...
    def release(self, state: Any) -> None: ...
    def collect_garbage(self) -> None: ...
    def settle_all(self, command: Any, error: BaseException | None) -> None: ...

def submit_program(s: SchedulerCore, queue: Any, program: Any, plan: Any,
                   inputs: tuple[Any, ...], peers: Any = None) -> tuple[Any, ...]: ...
def finish(command: CommandCore, error: BaseException | None) -> None: ...
def submit(device: Any, binary: Any, program_index: Any, inputs: Any) -> list[Any] | None: ...
def submit_spmd(mesh: Any, chips: tuple[Any, ...], binary: Any, program_index: Any, inputs: Any,
                mesh_tensor_type: type, placement: Any, grid: Any) -> list[Any] | None: ...
def run_program(command: CommandCore, banks: Any, inline_seconds: float) -> bool: ...
