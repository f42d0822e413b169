"""PyTorch on the tt device against PyTorch on the CPU, in the same run (`ttflow bench torch`).

- **Training step** of the digits MLP (64-64-10, batch 64, cross-entropy, `torch.optim.SGD`
  with momentum), written as a PyTorch user writes it: `torch.compile(model, backend="tt")`,
  the loss on the tt output, `loss.backward()`, `optimizer.step()`, `optimizer.zero_grad()`.
  The same loop on CPU torch is the peer; best of interleaved rounds, per-round ratios.
  The same step with the cross-entropy inside the compiled function (fewer, larger programs),
  and with the optimizer step compiled too (PyTorch's "compiling the optimizer" recipe: the
  update is one program).
- **Eager op**: `a + b` on 64x64 float32 tt tensors, queued back to back and waited for at the
  end, against CPU torch's.
- **Programs per step** (`device.stats.programs_run`) and the bytes that cross the host.
- **Where the tt step's CPU time goes**: torch's thread (the user's loop: dynamo's and
  AOTAutograd's wrappers, autograd, the optimizer, ttflow.torch's dispatch) and the event loop's
  thread (the emulator: scheduling and running the programs), per step, measured by thread CPU
  clocks during the rounds; the rest of the process (autograd's device thread) besides. They
  share one GIL, so the step is about their sum.
- **Peer: torch's own compile machinery** on the CPU: the same loop with
  `torch.compile(model, backend="aot_eager")` (dynamo and AOTAutograd, no device), to show what
  the wrappers a compiled model runs through cost before any device does anything.

Needs torch (`pip install ".[torch]" --extra-index-url https://download.pytorch.org/whl/cpu`).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["format_table", "run"]


def run(quick: bool = False, workers: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The suite on the default device; with `workers`, once per kind of worker (tt:0 opened
    with it), each against CPU torch in its own rounds: `{"workers": {kind: result}}`."""
    if workers is None:
        return _run(quick, None)
    return {"workers": {kind: _run(quick, kind) for kind in workers}}


def _run(quick: bool, workers: str | None) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import ttflow.torch as ttt
    from ttflow.torch._session import session  # runs a call on the loop thread: its CPU clock

    rounds, steps, ops = (2, 10, 200) if quick else (5, 40, 2000)
    if workers is not None:
        ttt.close()
        ttt.open_device(None, 0, workers=workers)
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    aot_model = copy.deepcopy(cpu_model)
    aot_compiled = torch.compile(aot_model, backend="aot_eager")
    aot_opt = torch.optim.SGD(aot_model.parameters(), lr=0.05, momentum=0.9)
    tt_model = copy.deepcopy(cpu_model).to("tt")
    compiled = torch.compile(tt_model, backend="tt")
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.05, momentum=0.9)
    tt_opt = torch.optim.SGD(tt_model.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(64, 64), torch.randint(0, 10, (64,))) for _ in range(steps)]

    def loss_fn(x: Any, y: Any) -> Any:
        return F.cross_entropy(tt_model(x), y)

    compiled_loss = torch.compile(loss_fn, backend="tt")  # the loss inside the compiled graph

    @torch.compile(backend="tt")
    def compiled_update() -> None:
        tt_opt.step()

    def settle() -> None:
        """The tt rounds' last releases run on the loop thread once it sees the pause: a CPU
        round lets them finish first, or they would be timed as CPU torch's."""
        ttt.synchronize()
        time.sleep(0.02)
        ttt.synchronize()

    def cpu_loop(model: Any, opt: Any) -> Callable[[], float]:
        def run() -> float:
            settle()
            begin = time.perf_counter()
            for x, y in batches:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            return (time.perf_counter() - begin) / steps

        return run

    cpu_steps = cpu_loop(cpu_model, cpu_opt)
    aot_steps = cpu_loop(aot_compiled, aot_opt)

    def tt_loop(loss_of: Callable[[Any, Any], Any], update: Callable[[], Any]) -> Callable[[], float]:
        """The user's training loop on tt, with the loss and the update as given."""

        def run() -> float:
            begin = time.perf_counter()
            loss = None
            for x, y in batches:
                loss = loss_of(x.to("tt"), y.to("tt"))
                loss.backward()
                update()
                tt_opt.zero_grad()
            assert loss is not None
            loss.item()  # waits for the last step
            return (time.perf_counter() - begin) / steps

        return run

    tt_steps = tt_loop(lambda x, y: F.cross_entropy(compiled(x), y), tt_opt.step)
    tt_steps_loss_compiled = tt_loop(compiled_loss, tt_opt.step)
    tt_steps_all_compiled = tt_loop(compiled_loss, compiled_update)

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    ta, tb = a.to("tt"), b.to("tt")

    def cpu_ops() -> float:
        settle()
        begin = time.perf_counter()
        for _ in range(ops):
            a + b
        return (time.perf_counter() - begin) / ops

    def tt_ops() -> float:
        begin = time.perf_counter()
        r = ta
        for _ in range(ops):
            r = ta + tb
        r.cpu()
        return (time.perf_counter() - begin) / ops

    # Compiling `opt.step()` makes dynamo say, once, that the optimizer's profiler annotation is
    # ignored (as it does for CUDA): not this benchmark's news.
    annotations = logging.getLogger("torch._dynamo.variables.ctx_manager")
    level = annotations.level
    annotations.setLevel(logging.ERROR)
    try:
        tt_steps(), tt_steps_loss_compiled(), tt_steps_all_compiled(), cpu_steps(), aot_steps(), tt_ops(), cpu_ops()  # warm up
    finally:
        annotations.setLevel(level)
    device = ttt.device()
    tt_step_times, cpu_step_times, tt_op_times, cpu_op_times, fused_times = [], [], [], [], []
    all_compiled_times: list[float] = []
    aot_times: list[float] = []
    all_compiled_programs = 0
    programs = h2d = d2h = 0
    torch_thread_cpu = loop_thread_cpu = process_cpu = 0.0
    for _ in range(rounds):
        before = device.stats
        clocks = time.thread_time(), session.call(time.thread_time), time.process_time()
        tt_step_times.append(tt_steps())
        torch_thread_cpu += time.thread_time() - clocks[0]
        loop_thread_cpu += session.call(time.thread_time) - clocks[1]
        process_cpu += time.process_time() - clocks[2]
        after = device.stats
        programs += after.programs_run - before.programs_run
        h2d += after.host_to_device_bytes - before.host_to_device_bytes
        d2h += after.device_to_host_bytes - before.device_to_host_bytes
        cpu_step_times.append(cpu_steps())
        aot_times.append(aot_steps())
        fused_times.append(tt_steps_loss_compiled())
        before = device.stats
        all_compiled_times.append(tt_steps_all_compiled())
        all_compiled_programs += device.stats.programs_run - before.programs_run
        tt_op_times.append(tt_ops())
        cpu_op_times.append(cpu_ops())
    n_steps = rounds * steps
    result = {
        "step_ms_tt": min(tt_step_times) * 1e3,
        "step_ms_cpu": min(cpu_step_times) * 1e3,
        "step_ratio": statistics.median(t / c for t, c in zip(tt_step_times, cpu_step_times)),
        # best over best: one noisy CPU round (a collection, another process) moves the median
        # of five per-round ratios far more than it moves either best.
        "step_ratio_best": min(tt_step_times) / min(cpu_step_times),
        "step_ratio_best_loss_compiled": min(fused_times) / min(cpu_step_times),
        "step_ratio_best_all_compiled": min(all_compiled_times) / min(cpu_step_times),
        "step_ms_tt_loss_compiled": min(fused_times) * 1e3,
        "step_ratio_loss_compiled": statistics.median(t / c for t, c in zip(fused_times, cpu_step_times)),
        "step_ms_tt_all_compiled": min(all_compiled_times) * 1e3,
        "step_ratio_all_compiled": statistics.median(t / c for t, c in zip(all_compiled_times, cpu_step_times)),
        "programs_per_step_all_compiled": all_compiled_programs / (rounds * steps),
        "eager_add_us_tt": min(tt_op_times) * 1e6,
        "eager_add_us_cpu": min(cpu_op_times) * 1e6,
        "eager_add_ratio": statistics.median(t / c for t, c in zip(tt_op_times, cpu_op_times)),
        "step_ms_cpu_aot_eager": min(aot_times) * 1e3,
        "step_ratio_cpu_aot_eager": statistics.median(a / c for a, c in zip(aot_times, cpu_step_times)),
        "cpu_ms_per_step_torch_thread": torch_thread_cpu / n_steps * 1e3,
        "cpu_ms_per_step_loop_thread": loop_thread_cpu / n_steps * 1e3,
        "cpu_ms_per_step_other_threads": (process_cpu - torch_thread_cpu - loop_thread_cpu) / n_steps * 1e3,
        "programs_per_step": programs / n_steps,
        "host_to_device_bytes_per_step": h2d / n_steps,
        "device_to_host_bytes_per_step": d2h / n_steps,  # the last step's loss, once per round
        "rounds": rounds,
        "steps_per_round": steps,
    }
    ttt.close()
    return result


def format_table(result: dict[str, Any]) -> str:
    if "workers" in result:
        return "\n\n".join(f"workers={kind}:\n" + format_table(one) for kind, one in result["workers"].items())
    return "\n".join([
        "PyTorch on tt vs CPU torch (same run; best of rounds; ratio best/best, then the rounds' median)",
        f"  training step (MLP 64-64-10, batch 64, SGD momentum): {result['step_ms_tt']:.2f} ms vs "
        f"{result['step_ms_cpu']:.2f} ms  ratio {result['step_ratio_best']:.1f}x ({result['step_ratio']:.1f}x)",
        f"  the same with the loss inside the compiled function: {result['step_ms_tt_loss_compiled']:.2f} ms  "
        f"ratio {result['step_ratio_best_loss_compiled']:.1f}x ({result['step_ratio_loss_compiled']:.1f}x)",
        f"  ... and the optimizer step compiled too: {result['step_ms_tt_all_compiled']:.2f} ms  "
        f"ratio {result['step_ratio_best_all_compiled']:.1f}x ({result['step_ratio_all_compiled']:.1f}x; "
        f"{result['programs_per_step_all_compiled']:.0f} programs a step)",
        f"  where the tt step's CPU goes (ms a step): torch's thread {result['cpu_ms_per_step_torch_thread']:.2f}, "
        f"the emulator's loop thread {result['cpu_ms_per_step_loop_thread']:.2f}, other threads "
        f"{result['cpu_ms_per_step_other_threads']:.2f} (one GIL)",
        f"  peer: CPU torch with torch.compile(backend='aot_eager'): {result['step_ms_cpu_aot_eager']:.2f} ms  "
        f"ratio {result['step_ms_cpu_aot_eager'] / result['step_ms_cpu']:.1f}x ({result['step_ratio_cpu_aot_eager']:.1f}x; "
        "torch's compile wrappers, no device)",
        f"  eager a + b (64x64 float32): {result['eager_add_us_tt']:.0f} us vs "
        f"{result['eager_add_us_cpu']:.1f} us  ratio {result['eager_add_ratio']:.0f}x",
        f"  programs per step: {result['programs_per_step']:.1f}; host->device "
        f"{result['host_to_device_bytes_per_step']:.0f} B/step, device->host "
        f"{result['device_to_host_bytes_per_step']:.0f} B/step",
    ])
