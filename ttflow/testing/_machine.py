"""`RuntimeStateMachine`: the runtime driven by hypothesis, checked against the numpy model.

The machine is built in layers, one file each: `_machine_base` (the device on a portal, the
model, the data rules and the invariants), `_machine_memory` (fragmentation, relocation,
compaction, spilling), `_machine_flight` (one queue run while the other's work stays in flight,
the inline threshold, the C fast path checked against its Python twin) and `_machine_traces`
(capture, replay, release, drop, donation of traced tensors). This module puts them together.
"""

from __future__ import annotations

from ._machine_base import ModelProgram
from ._machine_traces import TraceRules

__all__ = ["ModelProgram", "RuntimeStateMachine"]


class RuntimeStateMachine(TraceRules):
    """A hypothesis state machine over one device, to subclass.

    Class attributes to set: `backend` ("asyncio" or "trio"), `spec` (the device), `shapes`
    (the shapes of the tensors it makes) and `programs` (`ModelProgram`s the `submit` rule
    picks from, with inputs of matching shape and dtype). Then `TestX = MyMachine.TestCase`.

    Rules: `to_device` and `empty` (every dtype and layout, DRAM and L1), `to_layout`, `submit`
    (on tracked tensors or fresh ones), `write` (a new value in the tensor's host dtype),
    `write_between_runs` (a program, a write into one of its inputs, the program again),
    `deallocate` (then checks that a use of the handle raises DeallocatedTensorError),
    `deallocate_many` (a batch at once, as at the end of a front-end's step), `to_host`

    (compares with the model), `wait` (`tt.wait` or `await t`) and `drain`; for memory
    planning, `fragment` (fill a share of L1 or DRAM with tensors, free every other one) and
    `request` (then a tensor larger than any hole but within the free bytes: the runtime must
    relocate, evict or spill, never lose a byte), `convert_while_dram_comes_back` (DRAM full
    but for what tensors deallocated with writes still queued give back once those land, then a
    conversion into DRAM: made exactly when the free bytes and those hold it). The waiting
    rules let the device run until idle, then read every live tensor back and check it and the
    accounting exactly (`drain_and_check`, `DeviceModel.check_drained`); the invariants run
    after every step and wait for nothing: `memory_within_bounds` (`DeviceModel.check_bounds`) and
    `memory_views_consistent` (each space's `memory_view` adds up, nothing in it overlaps, every
    storage a tensor lists is in it). Teardown deallocates every handle, drains, checks that
    nothing is left allocated, and closes the device.

    Work in flight (`_machine_flight`): `run_one_queue` (one queue's worker runs until that
    queue is idle or waits for the other, whose records stay in flight), `writes_in_flight`
    (several writes to one tensor, the first held on CQ1's worker, then room asked for in L1),
    `inline_threshold` (-1, the default, or 1 s: held, fast path, all inline) and
    `submit_fast_path` (chains of `fast_programs` on tensors made with hand-written layouts);
    the invariant `fast_path_agrees` fails when the C fast path refused a program its Python
    twin says it must take. Traces (`_machine_traces`): `capture` (one to three submits, then a
    drain), `execute` (after writes into its inputs; then maybe an input deallocated at once, or
    an output written), `donate_traced_output` (must raise TraceError), `release` and `drop`
    (the handle garbage-collected: its pins must go too).

    To add a rule, use the helpers: `pick` (a tracked tensor), `push`, `convert`, `run_program`,
    `observe`, `call` (a synchronous runtime call on the loop: never awaits its result), `run`
    (an async call, with a timeout), and `self.model` / `self.device`.
    """
