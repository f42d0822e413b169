# cython: language_level=3, boundscheck=False, wraparound=False
"""Dispatch's per-command bookkeeping in C: the records the scheduler owns, and the fast path.

The classes here are the C layouts of scheduling state (a storage, a tensor's state, a command,
the scheduler's tables, the user's tensor handle); their Python subclasses (`_memory.Storage`,
`_sched.state.TensorState`, `_queue.Command`, `_sched.state.SchedulerState` and its
`_sched.scheduler.Scheduler`, `_tensor.Tensor`) add the methods. The fast path changes
scheduling state only through `SchedulerCore`'s methods, the ones the Python side calls too
(`allocate_geometry`, `free`, `add_storage`, `release`, `settle_all`), and the fields a submit
sets on the records it makes. The functions are the two halves of a tiny program's life when nothing unusual happens:
`submit_program` (the scheduler's side of `tt.submit`) and `run_program` (decide, run, commit
and complete in one call, from the queue's loop). Anything unusual (a conversion, an eviction, a
capture, a timeline, a failed input, an allocation that does not fit) makes `run_program`
return False before it changes anything, and the queue takes the general path, which says what
went wrong. Written in C because attribute access and calls are what a tiny program costs:
the same code in Python took 83k instructions per program, PyTorch eager's `x + 1` 26k.

This is the lowest layer: the types and callables it needs from above are handed to `bind`.

The records are not tracked by Python's cycle collector (`no_gc` for the C part, and the
instances the fast path makes are untracked): a chain of programs makes four of them per
program, and traversing them cost a tenth of dispatch. Their only cycles (a state and the command that writes it, a command and its queue) are broken when
the command completes, and every queued command completes, if only when its device closes; a
stored error is detached from its frames first.
"""

cimport cython

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *op)

from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

from weakref import ref as _weak_ref

from ttflow._errors import OutOfMemoryError

cdef object _storage_type = None
cdef object _state_type = None
cdef object _program_type = None
cdef object _tensor_type = None
cdef object _binary_type = None
cdef list _no_deps = None
cdef object _kernel_run = None
cdef object _l1 = None
cdef tuple _no_args = ()


cdef inline object _new(object cls):
    """An instance of `cls` (a Python subclass of one of the records here) from its type's own
    allocation slot: `Record.__new__(cls)` looks `__new__` up and calls it through
    `tp_new_wrapper`, which cost a tiny submit 45% of its instructions (3,610 -> 1,994 per
    submit, its records' deallocation included, by callgrind)."""
    return (<PyTypeObject*>cls).tp_new(cls, <PyObject*>_no_args, NULL)
# Renewed whenever a device's plan cache is cleared or turned off: a mesh's decided record
# (`submit_spmd`) made under an older token holds plans no longer kept, and is made again.
cdef object _plan_token = object()


def renew_plan_token():
    """Every mesh's decided record is stale (a chip's plans were cleared or are not kept)."""
    global _plan_token
    _plan_token = object()


def bind(storage_type, state_type, program_type, tensor_type, binary_type, list no_deps,
         kernel_run, l1):
    """The Python subclasses and callables the fast path uses (set once, at import)."""
    global _storage_type, _state_type, _program_type, _tensor_type, _binary_type, _no_deps
    global _kernel_run, _l1
    _storage_type, _state_type, _program_type = storage_type, state_type, program_type
    _tensor_type, _binary_type, _no_deps = tensor_type, binary_type, no_deps
    _kernel_run, _l1 = kernel_run, l1


@cython.no_gc
cdef class StorageCore:
    """One copy of a value in one layout, at one place in bank memory (`_memory.Storage`)."""

    cdef public object layout
    cdef public Py_ssize_t address
    cdef public Py_ssize_t page_size
    cdef public Py_ssize_t aligned_page_size
    cdef public Py_ssize_t num_pages
    cdef public object dims3
    cdef public Py_ssize_t nbytes
    cdef public object pages
    cdef public object _buffer
    cdef public list flights  # commands in flight whose records name it (None when none)
    cdef object __weakref__

    def __init__(self, layout, Py_ssize_t address, Py_ssize_t page_size,
                 Py_ssize_t aligned_page_size, Py_ssize_t num_pages, dims3):
        self.layout = layout
        self.address = address
        self.page_size = page_size
        self.aligned_page_size = aligned_page_size
        self.num_pages = num_pages
        # (batch, rows, cols) of the logical shape: how the tile kernels see it.
        self.dims3 = dims3
        self.nbytes = page_size * num_pages
        # A cached view of the pages in bank memory (filled by a run that works on pages in
        # place, dropped when the storage is freed, so no view outlives its allocation).
        self.pages = None
        self._buffer = None
        # Commands decided and handed to a worker, whose records read or write this storage:
        # nothing frees or moves it until they land (`_sched.state.SchedulerState.flight`).
        self.flights = None


@cython.no_gc
cdef class CommandCore:
    """The fields of a queued command (`_queue.Command`); `program`, `plan` and `converted` are
    a program's, `scheduler`, `reads` and `writes` a scheduler command's."""

    cdef public object queue
    cdef public list deps
    cdef public bint done
    cdef public object error
    cdef public object _event
    cdef public double started
    cdef public object record
    cdef public object capture
    cdef public object scheduler
    cdef public tuple reads
    cdef public tuple writes
    cdef public object program
    cdef public object plan
    cdef public list converted
    cdef public object sent  # the worker's ticket of a command decided ahead (`_queue`)
    cdef public Py_ssize_t footprint  # per-core L1 circular-buffer bytes it holds while it runs
    cdef public bint spill  # its L1 allocations go to DRAM (L1 cannot hold them: `make_room`)
    cdef public object peers  # a chip's place in its SPMD submit's rendezvous (collectives), or None
    cdef object __weakref__


@cython.no_gc
cdef class StateCore:
    """What the scheduler knows of one tensor (`_sched.state.TensorState`)."""

    cdef public object shape
    cdef public object dtype
    cdef public object declared
    cdef public list storages
    cdef public CommandCore last_writer
    cdef public CommandCore last_reader
    cdef public Py_ssize_t pending
    cdef public object error
    cdef public bint deallocated
    cdef public object moving
    cdef public object donated_to
    cdef public object name
    cdef public bint unretained  # `Tensor.retain` is False: a submit deallocates it once read
    cdef object __weakref__

    def __init__(self, shape, dtype, layout):
        self.shape = shape
        self.dtype = dtype
        self.declared = layout  # where it will live, before it has a storage
        self.storages = []
        self.last_writer = None
        self.last_reader = None
        self.pending = 0  # queued commands that read, write or move it
        self.error = None
        self.deallocated = False  # by `deallocate`, or its handle was dropped
        self.moving = None
        self.donated_to = None  # the program a donation consumed it in
        self.name = None  # the user's label (`Tensor.name`): memory views and maps show it
        self.unretained = False  # zero as made by `__new__` too: outputs are retained


@cython.no_gc
cdef class TensorCore:
    """The user's handle (`_tensor.Tensor`): a value's shape, dtype and device, and its state."""

    cdef readonly object shape
    cdef readonly object dtype
    cdef readonly object device
    cdef readonly StateCore _state
    cdef object __weakref__

    def __del__(self):
        # May run on any thread (garbage collection): the scheduler frees it on the loop thread.
        cdef StateCore state = self._state
        if state is not None and not state.deallocated:
            try:
                (<SchedulerCore?>self.device._scheduler)._dropped.append(state)
            except Exception:
                pass


cdef class QueueCore:
    """The fields of a command queue (`_queue.CommandQueue`) that every submit touches: its
    pending commands (a deque, oldest first), the event its task sleeps on when there are
    none, and whether it is closing."""

    cdef public object _pending
    cdef public object _append  # `_pending.append`, bound once
    cdef public object _wakeup
    cdef public bint _closing


cdef class SchedulerCore:
    """The scheduler's tables (`_sched.state.SchedulerState`), and its bookkeeping that runs for
    every command: allocating, freeing, keeping a storage on its tensor, releasing and
    completing."""

    cdef public dict _spaces
    cdef public object counters
    cdef public dict _owned
    cdef public dict _l1
    cdef public dict _pins
    cdef public dict _orphans
    cdef public object capturing
    cdef public object _dropped
    cdef public list listeners
    cdef public object _last_plan
    cdef public object cq0
    cdef public object cq1
    cdef public object l1_allocator
    cdef public bint evict_eagerly  # the "eager" policy: evictions are due before every program
    cdef public Py_ssize_t cb_depth  # the circular-buffer region at the bottom of L1 (`_sched.state`)
    cdef public set _free_on_landing  # storages freed while a command in flight names them
    cdef public Py_ssize_t plan_hits  # submits that found their program's plan kept (`plan`)
    cdef public Py_ssize_t plan_misses  # plans made (the first submit, or the cache off)
    cdef public bint plans_uncached  # `Device.program_cache_enabled` is False: no plan is kept
    cdef object __weakref__

    cpdef StorageCore allocate_geometry(self, tuple geometry, object owner):
        if self._dropped:
            self.collect_garbage()
        layout, space, page_size, aligned, num_pages, depth, dims3 = geometry
        address = space.reserve(depth)  # OutOfMemoryError when no block fits; tracks the peak
        cdef StorageCore storage = _new(_storage_type)
        PyObject_GC_UnTrack(<void*>storage)
        storage.layout = layout
        storage.address = address
        storage.page_size = page_size
        storage.aligned_page_size = aligned
        storage.num_pages = num_pages
        storage.dims3 = dims3
        storage.nbytes = storage.page_size * storage.num_pages
        self._owned[storage] = owner
        if owner is not None and layout.memory is _l1:
            self._l1[storage] = owner
        return storage

    cpdef add_storage(self, StateCore state, StorageCore storage):
        """`storage` is one of the state's storages from now on (a command's output, a
        conversion kept, a new tensor's home)."""
        state.storages.append(storage)

    cpdef free(self, StorageCore storage):
        if storage in self._owned:
            self._l1.pop(storage, None)
            if storage in self._pins:
                self._orphans[storage] = None  # a trace replays into it: kept until released
                return
            if storage.flights is not None:  # a command in flight still moves its bytes
                self._free_on_landing.add(storage)
                return
            del self._owned[storage]
            storage.pages = None
            self._spaces[storage.layout.memory].allocator.free(storage.address)

    cpdef release(self, StateCore state):
        """Frees a deallocated tensor's storages once no queued command needs them."""
        if state.pending == 0:
            for storage in state.storages:
                self.free(storage)
            state.storages.clear()

    cpdef collect_garbage(self):
        """Frees what dropped handles held: tensor states, and traces (anything else in the
        queue is dropped by its own `dropped()`)."""
        cdef StateCore state
        dropped = self._dropped
        while dropped:
            item = dropped.popleft()
            if not isinstance(item, StateCore):
                item.dropped()
                continue
            state = item
            state.deallocated = True
            if not state.pending:
                self.release(state)

    cpdef settle_all(self, CommandCore command, error):
        """A scheduler command is done: its states' writer, readers and pending counts (a
        deallocated state is freed once nothing queued needs it)."""
        cdef StateCore state
        for state in command.writes:
            state.error = error
            if state.last_writer is command:
                state.last_writer = None
            state.pending -= 1
            if state.deallocated and not state.pending and state.storages:
                self.release(state)
        for state in command.reads:
            if state.last_reader is command:
                state.last_reader = None
            state.pending -= 1
            if state.deallocated and not state.pending and state.storages:
                self.release(state)


def submit_program(SchedulerCore s, queue, program, plan, tuple inputs, peers=None):
    """Queues a program command on `queue` (CQ0) reading `inputs`; returns its output states.
    `peers`: the chip's place in its SPMD submit's rendezvous (a program with collectives), set
    before the command is queued, so a worker deciding it at once sees it."""
    return _submit_program(s, queue, program, plan, inputs, peers)


cdef tuple _submit_program(SchedulerCore s, queue, program, plan, tuple inputs, peers=None):
    cdef StateCore state
    cdef CommandCore writer
    cdef tuple specs = plan.output_states, spec
    cdef Py_ssize_t n = len(specs), k
    cdef tuple writes = PyTuple_New(n)
    for k in range(n):
        spec = specs[k]
        state = _new(_state_type)
        PyObject_GC_UnTrack(<void*>state)
        state.shape = spec[0]
        state.dtype = spec[1]
        state.declared = spec[2]
        storages = []
        PyObject_GC_UnTrack(<void*>storages)  # it holds storages, which refer to nothing that holds it
        state.storages = storages
        Py_INCREF(state)
        PyTuple_SET_ITEM(writes, k, state)
    PyObject_GC_UnTrack(<void*>writes)
    cdef CommandCore command = _new(_program_type)
    PyObject_GC_UnTrack(<void*>command)
    command.deps = _no_deps
    command.scheduler = s
    command.reads = inputs
    command.writes = writes
    command.program = program
    command.plan = plan
    command.converted = _no_deps
    command.peers = peers
    # `enqueue`, for a program: its outputs are new, so only its inputs' writers order it.
    cdef list deps = None
    for state in inputs:
        writer = state.last_writer
        if writer is not None and not writer.done and writer.queue is not queue:
            if deps is None:
                deps = command.deps = []
                PyObject_GC_UnTrack(<void*>deps)  # commands, which the cycle collector does not track
            deps.append(writer)
    if plan.donated:
        s._consume(command, queue, deps, program.name)
    capture = s.capturing
    if capture is not None:
        capture.admit(command, queue)
    # `CommandQueue.push`, inline
    cdef QueueCore q = queue
    if q._closing:
        queue.push(command)  # raises DeviceClosedError
    command.queue = queue
    q._append(command)
    wakeup = q._wakeup
    if wakeup is not None:
        wakeup.set()
        q._wakeup = None
    for state in inputs:
        state.last_reader = command
        state.pending += 1
    for state in writes:
        state.last_writer = command
        state.pending = 1
    return writes


def submit(device, binary, program_index, inputs):
    """`tt.submit` when every check passes at a glance: the output tensors, or None to let the
    checked path say what is wrong (or handle a donation)."""
    cdef TensorCore tensor
    cdef StateCore state
    if device.closed or type(binary) is not _binary_type or type(program_index) is not int:
        return None
    programs = binary.programs
    cdef Py_ssize_t index = program_index
    if not 0 <= index < len(programs):
        return None
    program = programs[index]
    cdef SchedulerCore s = device._scheduler
    # A kept plan, counted as a hit once the submit queues (a refused submit changes no
    # counter); a plan to make is the checked path's (`Scheduler.plan` counts the miss).
    last = s._last_plan
    if last is not None and last[0]() is program:
        plan = last[1]
    else:
        plan = s._plans.get(program)
        if plan is None:
            return None
        s._last_plan = (_weak_ref(program), plan)
    cdef tuple checks = plan.input_checks
    cdef list given
    if type(inputs) is list:
        given = inputs
    elif type(inputs) is tuple:
        given = list(inputs)
    else:
        return None
    if plan.checked_submit:  # a donation, collectives, const-eval (`Plan.checked_submit`)
        return None
    cdef Py_ssize_t n = len(checks), k
    if len(given) != n:
        return None
    cdef tuple check
    cdef list states = [None] * n
    for k in range(n):
        t = given[k]
        if type(t) is not _tensor_type:
            return None
        tensor = t
        state = tensor._state
        check = checks[k]
        dtype = check[1]
        if (tensor.device is not device or state.deallocated or state.unretained
                or tensor.shape != check[0]
                or (tensor.dtype is not dtype and not (check[2] and tensor.dtype.is_float))):
            return None
        states[k] = state
    cdef tuple reads = tuple(states)
    PyObject_GC_UnTrack(<void*>reads)
    s.plan_hits += 1  # `Scheduler.plan`'s count of a kept plan, in C
    cdef tuple outputs = _submit_program(s, s.cq0, program, plan, reads)
    cdef list result = [None] * len(outputs)
    for k in range(len(outputs)):
        result[k] = _wrap(_tensor_type, device, outputs[k])
    return result


cdef class MeshTensorCore:
    """The fields of a distributed tensor (`_mesh.tensor.MeshTensor`): its mesh, the chips its
    shards were laid out on (row-major), each chip's tensor state, how they were laid out.

    The per-chip `Tensor` handles (`_handles`) are made when first asked for: an SPMD submit
    makes none, so its host cost per chip is the chip's command and output state alone. Until
    then the mesh tensor owns its states' lifetimes (dropped, each is freed as a dropped
    handle's is); once made, the handles own them, as any handle does."""

    cdef public object _mesh
    cdef public tuple _chips
    cdef public tuple _states
    cdef public object _handles
    cdef public object _placement
    cdef public tuple _shape
    cdef public object _grid
    cdef object __weakref__

    def __del__(self):
        # May run on any thread (garbage collection): each chip's scheduler frees on its loop thread.
        cdef StateCore state
        cdef Py_ssize_t c
        if self._handles is not None or self._states is None:
            return
        for c in range(len(self._states)):
            state = self._states[c]
            if state is not None and not state.deallocated:
                try:
                    (<SchedulerCore?>self._chips[c]._scheduler)._dropped.append(state)
                except Exception:
                    pass


def submit_spmd(mesh, tuple chips, binary, program_index, inputs, mesh_tensor_type, placement, grid):
    """`tt.submit` on a mesh when every check passes at a glance on every chip: one per-device
    mesh tensor (of `mesh_tensor_type`, laid out as `placement` on `grid`) per output, or None
    (nothing queued) to let the checked path say what is wrong (or resolve collectives, or
    handle a donation).

    One pass decides for every chip (each chip's own plan, bound to its own memory, and each
    shard's liveness, shape and dtype) before any chip queues, so a refusal queues nothing
    anywhere; a second queues one program command per chip, as `submit` does on one device."""
    if type(binary) is not _binary_type or type(program_index) is not int:
        return None
    programs = binary.programs
    cdef Py_ssize_t index = program_index
    if not 0 <= index < len(programs):
        return None
    program = programs[index]
    cdef list given
    if type(inputs) is list:
        given = inputs
    elif type(inputs) is tuple:
        given = list(inputs)
    else:
        return None
    cdef Py_ssize_t n_in = len(given), n_chips = len(chips), k, c
    cdef list columns = [None] * n_in
    cdef MeshTensorCore t
    for k in range(n_in):
        if type(given[k]) is not mesh_tensor_type:
            return None
        t = given[k]
        # Shards in the mesh's own chip order (the very tuple; after a reshape the checked
        # path pairs shards with chips by chip).
        if t._mesh is not mesh or t._chips is not chips:
            return None
        columns[k] = t._states
    # The decided record of this program on these chips: each chip's plan (bound to its own
    # memory, made once per chip and program, as `Scheduler.plan` keeps them), reused by every
    # later submit of the program on the mesh.
    cdef tuple decided = mesh._decided
    cdef bint fresh = False  # each chip's plan looked up (and counted) by `plan` just now
    if (decided is None or decided[0]() is not program or decided[1] is not chips
            or decided[6] is not _plan_token):
        schedulers = tuple([chip._scheduler for chip in chips])
        plans = tuple([(<SchedulerCore>sched).plan(program) for sched in schedulers])
        first_plan = plans[0]
        decided = (_weak_ref(program), chips, schedulers, plans, first_plan.input_checks,
                   not first_plan.checked_submit, _plan_token)
        fresh = True
        # A chip whose plan cache is off keeps no plan: nor does the mesh, for it.
        mesh._decided = None if any([(<SchedulerCore>sched).plans_uncached for sched in schedulers]) else decided
    if not decided[5]:  # `Plan.checked_submit`: a donation, collectives, const-eval
        return None
    cdef tuple schedulers_t = decided[2], plans_t = decided[3]
    cdef tuple checks = decided[4], check
    if len(checks) != n_in:
        return None
    cdef list reads = [None] * n_chips
    cdef SchedulerCore s
    cdef StateCore state
    cdef tuple states, column
    for k in range(n_in):
        column = columns[k]
        check = checks[k]
        dtype = check[1]
        shape = check[0]
        for c in range(n_chips):
            state = column[c]
            if (state.deallocated or state.unretained or (state.shape is not shape and state.shape != shape)
                    or (state.dtype is not dtype and not (check[2] and state.dtype.is_float))):
                return None
    for c in range(n_chips):
        s = schedulers_t[c]
        if (<QueueCore>s.cq0)._closing:  # closing or closed
            return None
        states = PyTuple_New(n_in)
        for k in range(n_in):
            state = (<tuple>columns[k])[c]
            Py_INCREF(state)
            PyTuple_SET_ITEM(states, k, state)
        PyObject_GC_UnTrack(<void*>states)
        reads[c] = states
    cdef tuple outputs
    cdef list per_output = None
    cdef Py_ssize_t n_out = 0
    for c in range(n_chips):
        s = schedulers_t[c]
        if not fresh:
            s.plan_hits += 1  # the decided record's plan: this chip's, kept
        outputs = _submit_program(s, s.cq0, program, plans_t[c], <tuple>reads[c])
        if per_output is None:
            n_out = len(outputs)
            per_output = [[None] * n_chips for k in range(n_out)]
        for k in range(n_out):
            (<list>per_output[k])[c] = outputs[k]
    cdef list result = [None] * n_out
    cdef StateCore first
    for k in range(n_out):
        t = _new(mesh_tensor_type)
        t._mesh = mesh
        t._chips = chips
        t._states = tuple(<list>per_output[k])
        t._placement = placement
        first = t._states[0]
        t._shape = first.shape
        t._grid = grid
        result[k] = t
    return result


def wrap(cls, device, StateCore state):
    """A new handle (of `cls`, `_tensor.Tensor`) to `state` on `device`."""
    return _wrap(cls, device, state)


cdef TensorCore _wrap(cls, device, StateCore state):
    cdef TensorCore tensor = _new(cls)
    PyObject_GC_UnTrack(<void*>tensor)  # it refers to no object that could refer back to it
    tensor.shape = state.shape
    tensor.dtype = state.dtype
    tensor.device = device
    tensor._state = state
    return tensor


def finish(CommandCore command, error):
    """Marks `command` done with `error` (None: it succeeded) and lets go of everything it
    referenced: the one copy of that step, for every command (`_queue.Command.complete`) and
    for the inline run below.

    A finished command may stay reachable for a long time (a queued command's `deps`, an
    awaiting caller), so it must not keep tensors, storages or other commands alive: memory
    held stays bounded by what the user holds plus what is queued."""
    _finish(command, error)


cdef inline void _finish(CommandCore command, error):
    command.reads = ()
    command.writes = ()
    command.error = error
    command.done = True
    command.deps = _no_deps
    command.record = None
    command.capture = None
    if command.converted:
        command.converted = _no_deps
    if command._event is not None:
        command._event.set()


def run_program(CommandCore command, banks, double inline_seconds):
    """Decides, runs, commits and completes a program whose plan runs on the C kernel and
    whose inputs are ready where it reads them; False (having changed nothing) otherwise."""
    if type(command) is not _program_type or command.capture is not None:
        return False
    cdef CommandCore dep
    for dep in command.deps:
        if not dep.done:
            return False
    cdef SchedulerCore s = command.scheduler
    if (s._l1 and s.evict_eagerly) or s.listeners:  # an eviction may be due; a timeline records every command
        return False
    cdef StateCore state
    for state in command.reads:
        if state.error is not None:
            return False
    plan = command.plan
    bound = plan.bound
    if bound is None or bound.kernel is None or not plan.pagewise or bound.seconds > inline_seconds:
        return False
    space, code, rows, depth = bound.kernel
    # Its circular buffers go in the region at the bottom of L1, as deep as the largest so far
    # (nothing is allocated in L1 during an inline run of DRAM operands); an L1 program, or one
    # whose circular buffers need a deeper region, takes the general path.
    if space is _l1 or plan.footprint > s.cb_depth:
        return False
    cdef list addresses = []
    cdef StorageCore storage
    for state, layout in zip(command.reads, plan.input_layouts):
        for storage in state.storages:
            # Layouts are interned where storages are made; equality is the rule all the same
            # (`ProgramCommand.decide`), so that the two paths cannot drift apart.
            if storage.layout is layout or storage.layout == layout:
                addresses.append(storage.address)
                break
        else:
            return False
    cdef list outputs = []
    try:
        for state, geometry in zip(command.writes, bound.outputs):
            storage = s.allocate_geometry(geometry, state)
            outputs.append(storage)
            addresses.append(storage.address)
    except OutOfMemoryError:  # the general path decides again and fails the command with it
        for storage in outputs:
            s.free(storage)
        return False
    try:
        _kernel_run(banks[space], code, tuple(addresses), rows, depth)
    except BaseException:
        for storage in outputs:
            s.free(storage)
        raise
    # commit
    for state, storage in zip(command.writes, outputs):
        s.add_storage(state, storage)
    counters = s.counters
    counters["programs_run"] += 1
    counters["commands_run"] += 1
    counters["fast_path_programs"] += 1
    # complete
    s.settle_all(command, None)
    _finish(command, None)
    return True

