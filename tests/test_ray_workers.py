"""Chips in Ray actors (issue 28, part 2: `workers="ray"`).

One local Ray instance for the module (`ray.init(num_cpus=2)`, loopback only). The same
scenarios as tests/test_process_workers.py (programs, conversions, a chain, donation, eviction
under L1 pressure, a trace replay, reads and writes, raw bank reads), with thread workers at
`inline_seconds=-1` and with Ray actors: the same bytes. Meshes: an SPMD program and one with
collectives on a 1x2 mesh whose chips share an actor and one whose chips are in two actors; the
mesh examples (tests/test_mesh_examples.py) on Ray; a Galaxy-shaped 4x8 mesh of small chips
over 2 actors running the tensor-parallel MLP, equal to the 4x8 in-process run bit for bit and
to one chip within the sum tolerance. The host never touches a Ray chip's memory: its banks
refuse, and what cannot travel (host ops, debug hooks) fails typed. Faults: a killed actor
fails its chips' pending and later work with DeviceLostError naming the chip, the other
actor's chip goes on, and closing leaves no actor and no placement group.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='workers="ray" needs the ray extra: pip install ".[ray]"')

from test_process_workers import (  # noqa: E402
    _donation,
    _eviction,
    _gather_binary,
    _hosted_and_plain,
    _mlp_binary,
    _programs,
    _trace,
    values,
)

import ttflow as tt  # noqa: E402
from ttflow._memory.banks import RemoteBanks  # noqa: E402
from ttflow._workers.ray import RayQueueWorker, RayWorkers  # noqa: E402

pytestmark = pytest.mark.anyio

F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE = tt.TensorLayout.TILE
SMALL = tt.DeviceSpec.small()
RAY = {"workers": "ray", "ray_cpus": 0.1}  # a small bundle: a test's actors never wait for CPUs
LOST_WITHIN = 30.0


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


STARTED: list[tuple[Any, list[Any]]] = []  # (placement group, actor handles) of each start


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """After every test: each actor a device or mesh started is dead, each placement group
    removed (checked through their handles: the state API needs the dashboard)."""
    start = RayWorkers.start

    def recorded(self: RayWorkers) -> None:
        start(self)
        STARTED.append((self.placement, [group.actor for group in self.groups]))

    monkeypatch.setattr(RayWorkers, "start", recorded)
    STARTED.clear()
    yield
    for placement, actors in STARTED:
        assert ray.util.placement_group_table(placement)["state"] == "REMOVED"
        for actor in actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.ping.remote(), timeout=LOST_WITHIN)


def _workers(device: tt.Device) -> list[RayQueueWorker]:
    workers = [device._cq0._worker, device._cq1._worker]
    assert all(isinstance(w, RayQueueWorker) for w in workers)
    return workers  # type: ignore[return-value]


async def both(scenario: Any, **ray_kwargs: Any) -> list[np.ndarray]:
    """`scenario(open_kwargs)` with thread workers (every record on a worker thread) and with a
    Ray actor: the same bytes."""
    with anyio.fail_after(120):
        threads = await scenario({"workers": "thread", "inline_seconds": -1})
        rays = await scenario({**RAY, "inline_seconds": None, **ray_kwargs})
    assert len(threads) == len(rays) > 0
    for a, b in zip(threads, rays):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    return rays


# -- the same bytes ------------------------------------------------------------------------------


async def test_programs_conversions_writes_and_bank_reads_equal_thread_workers() -> None:
    await both(_programs)


async def test_a_chain_goes_in_few_actor_calls() -> None:
    b = tt.ProgramBuilder("step")
    x = b.input((64, 64), tt.Layout(DRAM, TILE, F32))
    b.output(b.add(b.mul(x, 0.5), 1.0), tt.Layout(DRAM, TILE, F32))
    binary = tt.Binary([b.build()])
    calls: list[int] = []

    async def chain(kwargs: dict[str, Any]) -> list[np.ndarray]:
        async with tt.open_device(SMALL, **kwargs) as device:
            t = tt.to_device(values((64, 64)), device, tt.Layout(DRAM, TILE))
            await t
            if kwargs["workers"] == "ray":
                cq0, _ = _workers(device)
                before = cq0.sent_messages
                cq0.pause()  # the chain queues up behind the first program, then goes in batches
            outs = []
            for _ in range(24):
                (t,) = tt.submit(device, binary, 0, [t])
                outs.append(t)
            if kwargs["workers"] == "ray":
                await anyio.sleep(0.05)
                cq0.resume()
            await outs[-1]
            if kwargs["workers"] == "ray":
                calls.append(cq0.sent_messages - before)
                assert cq0.local_jobs == 0
            got = [await tt.to_host(outs[-1])]  # the chain's last value (each step reads the last)
        return got

    await both(chain)
    assert calls[0] <= 24 // 4, f"{calls[0]} actor calls for 24 chained programs: not batched"


async def test_a_batch_s_outcomes_land_on_their_own_programs() -> None:
    """A chain held behind a paused worker goes to the actor in few calls; one of its programs
    fails in its run (x / 0 stored through BFLOAT8_B, a LayoutError): each program's outcome,
    value or error, must be its own, as with thread workers."""
    tile = tt.Layout(DRAM, TILE, F32)
    b = tt.ProgramBuilder("step")
    x = b.input((32, 32), tile)
    b.output(b.add(b.mul(x, 0.5), 1.0), tile)
    b2 = tt.ProgramBuilder("fails_in_its_run")
    y = b2.input((32, 32), tile)
    b2.output(b2.add(b2.typecast(b2.typecast(b2.div(y, 0.0), tt.DataType.BFLOAT8_B), F32), y), tile)
    binary = tt.Binary([b.build(), b2.build()])
    order = [0, 0, 0, 1, 0, 0]

    async def chain(kwargs: dict[str, Any]) -> list[Any]:
        outcomes: list[Any] = []
        async with tt.open_device(SMALL, **kwargs) as device:
            t = tt.to_device(values((32, 32)), device, tile)
            await t
            workers = _workers(device) if kwargs["workers"] == "ray" else []
            before = sum(w.sent_messages for w in workers)
            for w in workers:
                w.pause()
            outs = []
            for index in order:
                (t,) = tt.submit(device, binary, index, [t])
                outs.append(t)
            await anyio.sleep(0.05)
            for w in workers:
                w.resume()
            for out in outs:
                try:
                    outcomes.append((await tt.to_host(out)).tobytes())
                except tt.TTFlowError as exc:
                    outcomes.append(type(exc))
            if workers:
                assert sum(w.sent_messages for w in workers) - before < len(order)  # batched
        return outcomes

    with anyio.fail_after(60):
        threads = await chain({"workers": "thread", "inline_seconds": -1})
        rays = await chain(dict(RAY))
    assert threads[3:] == [tt.LayoutError] * 3 and all(type(v) is bytes for v in threads[:3])
    assert rays == threads


async def test_donation() -> None:
    await both(_donation)


async def test_eviction_under_l1_pressure() -> None:
    await both(_eviction)


async def test_trace_replay() -> None:
    await both(_trace)


async def _mesh(kwargs: dict[str, Any]) -> list[np.ndarray]:
    binary = _mlp_binary()
    gather = _gather_binary()
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), **kwargs) as mesh:
        xt = tt.to_device(values((128, 40)), mesh, tt.Layout(DRAM, TILE), mapper=tt.shard(0))
        wt = tt.to_device(values((40, 24), F32, 1), mesh)
        ys = [tt.submit(mesh, binary, 0, [xt, wt])[0] for _ in range(3)]
        out = [await tt.to_host(y, tt.concat(0)) for y in ys]
        g = tt.to_device(values((16, 12), F32, 2), mesh, mapper=tt.shard(0))
        for _ in range(2):
            (z,) = tt.submit(mesh, gather, 0, [g])
            out.append(await tt.to_host(z, tt.concat(0)))
        if kwargs["workers"] == "ray":
            pids = mesh.worker_pids
            assert None not in pids
            assert (pids[0] == pids[1]) == (kwargs.get("chips_per_worker", 1) == 2)
            for chip in mesh.chips:
                cq0, _ = _workers(chip)
                assert cq0.sent_jobs >= 5 and cq0.local_jobs == 0  # the collectives travelled too
    return out


@pytest.mark.parametrize(("chips_per_worker", "strategy"), [(1, "PACK"), (2, "PACK"), (1, "SPREAD")])
async def test_a_1x2_mesh_spmd_program_and_collectives(chips_per_worker: int, strategy: str) -> None:
    await both(_mesh, chips_per_worker=chips_per_worker, ray_strategy=strategy)
    (placement, actors), = STARTED
    assert len(actors) == 2 // chips_per_worker
    assert ray.util.placement_group_table(placement)["strategy"] == strategy


async def test_a_4x8_galaxy_of_small_chips_over_2_actors_runs_the_tensor_parallel_mlp() -> None:
    from ttflow._bench.mesh import mlp_binary, numpy_mlp

    rows, d, hidden, chips = 32, 64, 256, 32
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    a = (rng.standard_normal((d, hidden)) * 0.1).astype(np.float32)
    w = (rng.standard_normal((hidden, d)) * 0.1).astype(np.float32)

    async def galaxy(kwargs: dict[str, Any]) -> np.ndarray:
        binary = mlp_binary(chips, rows, d, hidden)
        async with tt.open_mesh_device(tt.MeshSpec((4, 8), chip=SMALL), **kwargs) as mesh:
            if kwargs["workers"] == "ray":
                assert len(set(mesh.worker_pids)) == 2
            ins = [tt.to_device(x, mesh, mapper=tt.replicate()), tt.to_device(a, mesh, mapper=tt.shard(1)),
                   tt.to_device(w, mesh, mapper=tt.shard(0))]
            (y,) = tt.submit(mesh, binary, 0, ins)
            return await tt.to_host(tt.device_tensors(y)[0])

    async def one_chip() -> np.ndarray:
        async with tt.open_device(SMALL) as device:
            (y,) = tt.submit(device, mlp_binary(1, rows, d, hidden), 0, [tt.to_device(v, device) for v in (x, a, w)])
            return await tt.to_host(y)

    with anyio.fail_after(240):
        on_ray = await galaxy({**RAY, "chips_per_worker": 16})
        in_process = await galaxy({"workers": "thread"})
        single = await one_chip()
    assert on_ray.tobytes() == in_process.tobytes()
    # 32 partial sums added in the all_reduce's order, against one matmul's: the sum tolerance
    np.testing.assert_allclose(on_ray, single, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(on_ray, numpy_mlp(x, a, w), rtol=1e-4, atol=1e-4)


# -- the mesh examples, on Ray -------------------------------------------------------------------


def _on_ray(test: Any) -> Any:
    @functools.wraps(test)
    async def wrapper(*args: Any, **kwargs: Any) -> None:
        opened, opened_mesh = tt.open_device, tt.open_mesh_device
        tt.open_mesh_device = functools.partial(opened_mesh, chips_per_worker=4, **RAY)  # type: ignore[assignment]
        try:
            with anyio.fail_after(240):
                await test(*args, **kwargs)
            assert STARTED, "the example opened no mesh on Ray"
        finally:
            tt.open_device, tt.open_mesh_device = opened, opened_mesh  # type: ignore[assignment]

    return wrapper


def _borrow_examples() -> None:
    import inspect

    import test_mesh_examples as examples

    for name, test in vars(examples).items():
        if name.startswith("test_") and inspect.iscoroutinefunction(test):
            wrapped = pytest.mark.usefixtures("spmd_path")(_on_ray(test))  # its marks go with it (wraps)
            globals()[f"{name}_on_ray"] = wrapped


_borrow_examples()


# -- the host never touches a Ray chip's memory --------------------------------------------------


async def test_the_host_side_banks_refuse_every_access() -> None:
    async with tt.open_device(SMALL, **RAY) as device:
        banks = device._banks[DRAM]
        assert isinstance(banks, RemoteBanks)
        for touch in (lambda: banks[0, 0:4], lambda: np.asarray(banks), lambda: banks.shape,
                      lambda: banks.__setitem__((0, 0), 1), lambda: len(banks)):
            with pytest.raises(tt.RemoteMemoryError, match="Ray actor"):
                touch()
        from ttflow._commands import Record, Store, run

        t = tt.to_device(values((64, 64)), device, tt.Layout(DRAM, TILE))
        await t
        storage = t._state.storages[0]  # a host-side run of a record on the stand-in raises
        with pytest.raises(tt.RemoteMemoryError):
            run(Record((Store(storage, values((64, 64)), None),)), device._banks)
        with pytest.raises(ValueError, match="inline_seconds"):
            device.inline_seconds = 0.001
        assert device.inline_seconds < 0
        # The bytes are the actor's: a raw bank read travels there, and equals the value read back.
        assert len(device.read_bank(DRAM, 0, 0, 64)) == 64
        with pytest.raises(tt.ShapeError):
            device.read_bank(DRAM, 99, 0, 4)


async def test_host_ops_and_debug_hooks_are_refused_at_once_and_the_device_goes_on() -> None:
    hosted, plain = _hosted_and_plain()
    seen: list[str] = []
    with anyio.fail_after(60):
        async with tt.open_device(SMALL, **RAY) as device:
            t = tt.to_device(values((64, 64)), device, tt.Layout(DRAM, TILE))
            # Refused at once, before anything is queued: at the submit, at the hooks' block.
            for _ in range(2):  # the second submit too (no plan was cached for a fast path)
                with pytest.raises(tt.RemoteMemoryError, match="host ops"):
                    tt.submit(device, hosted, 0, [t])
            with pytest.raises(tt.RemoteMemoryError, match="debug_hooks"):
                with tt.debug_hooks(device, post_op=lambda ctx: seen.append(ctx.name)):
                    pass
            assert device.stats.programs_run == 0
            got = await tt.to_host(tt.submit(device, plain, 0, [t])[0])
    async with tt.open_device(SMALL) as device:
        want = await tt.to_host(tt.submit(device, plain, 0, [tt.to_device(values((64, 64)), device,
                                                                           tt.Layout(DRAM, TILE))])[0])
    assert seen == []  # no hook ran on a stand-in
    assert got.tobytes() == want.tobytes()


async def test_ray_must_be_initialised_and_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(ray, "is_initialized", lambda: False)
        with pytest.raises(tt.TTFlowError, match=r"ray\.init\(\)"):
            async with tt.open_device(SMALL, workers="ray"):
                pass
        with pytest.raises(tt.TTFlowError, match=r"ray\.init\(\)"):
            async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), workers="ray"):
                pass
    with pytest.raises(ValueError, match="inline_seconds"):
        async with tt.open_device(SMALL, workers="ray", inline_seconds=0.0):
            pass
    with pytest.raises(ValueError, match="ray_cpus"):
        async with tt.open_device(SMALL, workers="ray", ray_cpus=0):
            pass
    with pytest.raises(ValueError, match="chips_per_worker"):
        async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), workers="ray", chips_per_worker=0):
            pass
    with pytest.raises(ValueError, match="ray_strategy"):
        async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), workers="ray", ray_strategy="NEAR"):
            pass
    with pytest.raises(ValueError, match="only for workers='ray'"):
        async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), chips_per_worker=2):
            pass


# -- faults and clean closing --------------------------------------------------------------------


async def test_a_killed_actor_fails_its_chips_typed_the_other_goes_on_and_close_is_clean() -> None:
    binary = _mlp_binary()
    with anyio.fail_after(LOST_WITHIN * 3):
        async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), **RAY) as mesh:
            workers = mesh.chips[0]._process.workers
            placement = workers.placement
            actors = [group.actor for group in workers.groups]
            assert len(actors) == 2 and len(set(mesh.worker_pids)) == 2
            xt = tt.to_device(values((128, 40)), mesh, tt.Layout(DRAM, TILE), mapper=tt.shard(0))
            wt = tt.to_device(values((40, 24), F32, 1), mesh)
            before = await tt.to_host(tt.submit(mesh, binary, 0, [xt, wt])[0], tt.concat(0))
            ray.kill(actors[0], no_restart=True)
            (y,) = tt.submit(mesh, binary, 0, [xt, wt])
            lost, other = tt.device_tensors(y)
            with pytest.raises(tt.DeviceLostError) as caught:
                with anyio.fail_after(LOST_WITHIN):
                    await tt.to_host(lost)
            assert caught.value.chip == (0, 0) and "Ray actor" in str(caught.value)
            assert (await tt.to_host(other)).tobytes() == before[64:].tobytes()
            with pytest.raises(tt.DeviceLostError):  # later work on the lost chip too
                with anyio.fail_after(LOST_WITHIN):
                    await tt.to_host(tt.to_device(values((8, 8)), mesh.chips[0]))
            later = await tt.to_host(tt.submit(mesh.chips[1], binary, 0, [tt.device_tensors(xt)[1],
                                                                        tt.device_tensors(wt)[1]])[0])
            assert later.tobytes() == before[64:].tobytes()
    assert STARTED == [(placement, actors)]  # closed: checked dead and removed after the test


async def test_closing_with_work_queued_and_on_an_error_leaves_no_actor() -> None:
    binary = _mlp_binary()
    with anyio.fail_after(60):
        with pytest.raises(KeyError):
            async with tt.open_device(SMALL, **RAY) as device:
                xt = tt.to_device(values((64, 40)), device, tt.Layout(DRAM, TILE))
                wt = tt.to_device(values((40, 24), F32, 1), device)
                for _ in range(6):
                    tt.submit(device, binary, 0, [xt, wt])
                raise KeyError("the block failed")
        async with tt.open_device(SMALL, **RAY) as device:
            xt = tt.to_device(values((64, 40)), device, tt.Layout(DRAM, TILE))
            ys = [tt.submit(device, binary, 0, [xt, tt.to_device(values((40, 24), F32, 1), device)])[0]
                  for _ in range(6)]  # queued when the block ends: drained, then the actor goes
            got = [await tt.to_host(y) for y in ys]
        assert all(g.tobytes() == got[0].tobytes() for g in got)
    assert len(STARTED) == 2  # both checked after the test
