"""The tt torch device as a PyTorch user meets it: tensors, views, autograd, checkpoints.

Every value is compared with the same computation on CPU torch.
"""

from __future__ import annotations

import copy
import gc
import io
import inspect
import warnings

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch import nn

import ttflow as tt
from ttflow.torch import _storage
from ttflow.torch._session import session

pytestmark = pytest.mark.filterwarnings("ignore:aten.*ran on the CPU")


@pytest.fixture
def fresh():
    """A newly opened default device; everything closed afterwards."""
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


VIEWS = {
    "T": lambda a: a.T,
    "slice": lambda a: a[1:, ::2],
    "select": lambda a: a[:, 1],
    "expand": lambda a: a[:1].expand(3, 4),
    "view": lambda a: a.view(2, 6),
    "flatten": lambda a: a.flatten(),
    "unsqueeze": lambda a: a.unsqueeze(1),
    "permute3": lambda a: a.view(3, 2, 2).permute(2, 0, 1),
    "offset_transpose": lambda a: a[1:].T,
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_read_like_cpu(fresh, name):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = VIEWS[name]
    assert torch.equal(view(x.to("tt")).cpu(), view(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool,
                                   torch.float64, torch.float16, torch.uint8])
def test_round_trip_keeps_value_and_dtype(fresh, dtype):
    x = torch.randn(5, 7) * 50
    x = (x > 0) if dtype == torch.bool else x.to(dtype)
    back = x.to("tt").to("cpu")
    assert back.dtype == dtype and torch.equal(back, x)


def test_writes_through_a_view_reach_the_base(fresh):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = x.to("tt")
    t[:, 1] = 5
    t.T[0].mul_(0)  # the first column, through a transposed view
    x[:, 1] = 5
    x.T[0].mul_(0)
    assert torch.equal(t.cpu(), x)


def test_in_place_ops_are_seen_by_every_alias(fresh):
    model = nn.Linear(4, 3).to("tt")
    state = model.state_dict()
    assert state["weight"].data_ptr() == model.weight.data_ptr()  # state_dict aliases, as torch's does
    expected = model.weight.detach().cpu() * 0.5
    with torch.no_grad():
        model.weight.mul_(0.5)
    assert torch.equal(state["weight"].cpu(), expected)


def test_eager_autograd_matches_cpu(fresh):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    tt_model = copy.deepcopy(cpu).to("tt")
    x = torch.randn(4, 6)
    xt = x.to("tt").requires_grad_()
    x.requires_grad_()
    cpu(x).pow(2).sum().backward()
    tt_model(xt).pow(2).sum().backward()
    for (name, p), q in zip(cpu.named_parameters(), tt_model.parameters()):
        assert q.grad is not None and q.grad.device.type == "tt", name
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-6)


def test_save_load_and_deepcopy_like_cuda(fresh):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to("tt")
    expected = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # back on tt:0, as a CUDA checkpoint comes back on cuda:0
    assert {v.device.type for v in loaded.values()} == {"tt"}
    assert all(torch.equal(loaded[k].cpu(), expected[k]) for k in expected)
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert {v.device.type for v in on_cpu.values()} == {"cpu"}
    assert all(torch.equal(on_cpu[k], expected[k]) for k in expected)
    clone = copy.deepcopy(model)
    assert clone[0].weight.device.type == "tt" and clone[0].weight.data_ptr() != model[0].weight.data_ptr()
    with torch.no_grad():
        model[0].weight.zero_()
    assert torch.equal(clone[0].weight.cpu(), expected["0.weight"])  # a copy, not an alias
    fresh_model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to("tt")
    buffer.seek(0)
    fresh_model.load_state_dict(torch.load(buffer))
    assert torch.equal(fresh_model[1].bias.cpu(), expected["1.bias"])


def test_inference_mode_then_to_cpu(fresh):
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        out = copy.deepcopy(model).to("tt")(x.to("tt"))
    torch.testing.assert_close(out.to("cpu"), model(x).detach())


def test_printing_shows_the_value_and_the_device(fresh):
    text = repr(torch.tensor([[1.5, 2.0]]).to("tt"))
    assert "1.5000" in text and "device='tt:0'" in text


def test_mixing_devices_is_torchs_error(fresh):
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, 2).to("tt") + torch.ones(2, 2)


def _dram_used(device):
    return session.call(device.memory_used, tt.MemorySpace.DRAM)  # on the loop thread, after the inbox


def test_dropped_tensors_free_their_device_memory(fresh):
    keep = torch.randn(64, 64).to("tt")  # a held tensor's memory stays held

    def step():
        a = torch.randn(64, 64).to("tt")
        b = (a * 2 + 1).T
        b.cpu()

    step()  # warm-up: the programs and the cached scalar values (1 here) are made once
    gc.collect()
    slots, used = _storage.live_slots(), _dram_used(fresh)
    for _ in range(20):
        step()
    gc.collect()
    assert _storage.live_slots() == slots
    assert _dram_used(fresh) == used
    torch.testing.assert_close(keep.cpu() * 2, (keep * 2).cpu())


def test_int64_results_past_int32_raise_instead_of_wrapping(fresh):
    """int64 lives as INT32 on the device. CPU torch's int64 does not wrap at 2**31, so a result
    past int32 must be an error (naming the op), never a wrapped number; int32 tensors wrap on
    both devices, and int64 results in range are exact."""
    counts = torch.tensor([[30000, 70000, -5, 2]])
    big = torch.full((4,), 2**30)

    def hashed(ids):
        return ids * 70001 - ids  # a product past int32, whatever it is for

    compiled = torch.compile(hashed, backend="tt")
    with pytest.raises(tt.ProgramError, match=r"aten.mul.Tensor gives an int64 tensor.*4900000000"):
        (counts.to("tt") * 70000).cpu()
    with pytest.raises(tt.ProgramError, match=r"aten.sum.* gives an int64 tensor.*4294967296"):
        big.to("tt").sum().item()
    with pytest.raises(tt.ProgramError, match=r"aten.mul.Tensor gives an int64 tensor.*does not fit INT32"):
        compiled(counts.to("tt")).cpu()
    with pytest.raises(tt.ProgramError, match="(?i)int32"):  # not 2**31 - 1, as the device saturates
        torch.tensor([3e9, 1.0]).to("tt").long().cpu()
    # An integer division by zero: CPU torch raises ZeroDivisionError; the device would give 0.
    for divide in (lambda a, b: a // b, torch.remainder, torch.fmod):
        with pytest.raises(tt.ProgramError, match="integer division by zero"):
            divide(counts.to("tt"), torch.tensor([[3, 0, 1, 1]]).to("tt")).cpu()
        with pytest.raises(tt.ProgramError, match="divides integers: integer division by zero"):
            divide(counts.int().to("tt"), torch.tensor([[3, 0, 1, 1]], dtype=torch.int32).to("tt")).cpu()
    # In range: exact, as CPU int64; int32 wraps as on CPU.
    small = torch.tensor([[3, 7, -5, 2]])
    assert torch.equal(compiled(small.to("tt")).cpu(), hashed(small))
    assert torch.equal((small.to("tt") * 70000).sum().cpu(), (small * 70000).sum())
    as_int32 = counts.int()
    assert torch.equal((as_int32.to("tt") * 70000).cpu(), as_int32 * 70000)
    # The failed runs left nothing behind.
    gc.collect()
    assert _storage.live_slots() == 0


def test_indices_follow_torch_negative_wrap_and_out_of_range_error(fresh):
    """x[-1] is the last row (the device's gather would clamp -1 to row 0), and an index out of
    range is an error (torch's IndexError; the device would clamp it), eager and compiled."""
    x = torch.arange(10.0).reshape(5, 2)
    on_tt = x.to("tt")
    neg = torch.tensor([-1, 1, -5])
    assert torch.equal(on_tt[neg.to("tt")].cpu(), x[neg])
    compiled = torch.compile(lambda t, i: t[i] * 2, backend="tt")
    assert torch.equal(compiled(on_tt, neg.to("tt")).cpu(), x[neg] * 2)
    bad = torch.tensor([7, 1])
    with pytest.raises(IndexError):
        x[bad]
    cases = {
        "aten.index.Tensor indexes": lambda t, i: t[i],
        "index 7 is out of range for 5 rows": lambda t, i: nn.functional.embedding(i, t),
        "aten.index_select.default indexes": lambda t, i: t.index_select(0, i),
        "aten.gather.default indexes": lambda t, i: t.gather(1, i.reshape(2, 1)),
    }
    for match, fn in cases.items():
        with pytest.raises(tt.ProgramError, match=match):
            fn(on_tt, bad.to("tt")).cpu()
    with pytest.raises(tt.ProgramError, match="aten.index.Tensor indexes"):
        compiled(on_tt, bad.to("tt")).cpu()
    torch.testing.assert_close((on_tt * 2).cpu(), x * 2)  # the device goes on


def test_eager_programs_stay_bounded_however_many_shapes_come(fresh, monkeypatch):
    """Each new shape traces a program; past the cache's capacity the oldest go (a workload of
    ever-new shapes had kept every program it traced, 27 KB each), and a signature that comes
    back is traced again, with the same values."""
    from ttflow.torch import _eager

    monkeypatch.setattr(_eager._entries, "capacity", 8)
    _eager._entries.clear()
    x = torch.randn(40, 3)
    on_tt = x.to("tt")
    for n in (*range(1, 31), 1, 2):  # 1 and 2 were evicted: traced again
        torch.testing.assert_close((on_tt[:n] * 2 + 1).sum(0).cpu(), (x[:n] * 2 + 1).sum(0))
        assert len(_eager._entries) <= 8


def test_torch_tt_answers_what_device_agnostic_code_asks(fresh):
    """`torch.cuda`'s everyday calls, on `torch.tt`, and `torch.accelerator.synchronize()`
    (which had raised "Backend doesn't support synchronizing"): each against what it reports."""
    base = torch.tt.memory_allocated()
    a = torch.randn(1000, 100).to("tt")
    assert torch.tt.memory_allocated() - base >= 1000 * 100 * 4  # its tiles, padded
    assert torch.tt.memory_reserved() == torch.tt.memory_allocated()
    del a
    assert torch.tt.memory_allocated() == base  # freed at once, not at the next collection
    torch.tt.empty_cache()
    assert "wormhole_n150" in torch.tt.get_device_name()
    torch.tt.manual_seed(3)
    drawn = torch.randn(3, device="tt").cpu()
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.randn(3)) and torch.tt.initial_seed() == 3
    # synchronize waits: a posted op has run once it returns (without it, the loop thread would
    # still be waiting for the caller to pause).
    x = torch.randn(64, 64).to("tt")
    before = fresh.stats.programs_run
    y = x * 3 + 1
    torch.accelerator.synchronize()
    assert fresh.stats.programs_run > before
    torch.testing.assert_close(y.cpu(), x.cpu() * 3 + 1)
    # ... and raises what a queued op met, as torch's RuntimeError naming it, while it is held.
    overflowed = torch.tensor([70000]).to("tt") * 70000
    with pytest.raises(RuntimeError, match="aten.mul.Tensor gives an int64 tensor.*does not fit INT32"):
        torch.accelerator.synchronize()
    with pytest.raises(RuntimeError, match="does not fit INT32"):
        torch.accelerator.current_stream().synchronize()
    del overflowed
    torch.accelerator.synchronize()
    ttt.open_device(tt.DeviceSpec.small(), index=1)
    torch.tt.set_device(1)
    try:
        held = torch.randn(2, device="tt")
        assert torch.tt.current_device() == 1 and held.device == torch.device("tt", 1)
        assert torch.tt.memory_allocated("tt:1") > 0 and "small" in torch.tt.get_device_name(1)
    finally:
        torch.tt.set_device("tt:0")
    assert torch.randn(2, device="tt").device == torch.device("tt", 0)
    with torch.tt.device(1):
        assert torch.randn(2, device="tt").device == torch.device("tt", 1)
        with torch.tt.device("tt:0"):
            assert torch.tt.current_device() == 0
        assert torch.tt.current_device() == 1
    assert torch.tt.current_device() == 0


def test_a_loop_of_eager_ops_holds_only_what_it_holds(fresh):
    # Each `r = a + b` frees the previous r: its device memory must go back as the loop runs,
    # not at the next tensor torch makes on tt (an op whose result goes straight into its
    # out= tensor makes none). Nothing here asks how many slots are live (that would free them).
    a, b = torch.randn(64, 64).to("tt"), torch.randn(64, 64).to("tt")
    r = a + b
    r.cpu()
    used = _dram_used(fresh)
    for _ in range(50):
        r = a + b
        r.add_(a)
    r.cpu()
    assert _dram_used(fresh) <= used + 2 * 64 * 64 * 4  # a result in flight, not fifty
    torch.testing.assert_close(r.cpu(), (a.cpu() + b.cpu()) + a.cpu())


def test_an_op_with_no_device_lowering_warns_once_and_runs_on_the_cpu(fresh):
    from ttflow.torch import _fallback

    _fallback.warned.clear()  # once per op and process, as torch's own warn-once
    x, a = torch.tensor([[0.5, 1.5]]), torch.tensor([[2.0, 3.0]])  # igamma: no device lowering
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r1 = torch.igamma(a.to("tt"), x.to("tt"))
        r2 = torch.igamma(a.to("tt"), x.to("tt") * 2)
    assert torch.equal(r1.cpu(), torch.igamma(a, x)) and torch.equal(r2.cpu(), torch.igamma(a, x * 2))
    cpu_warnings = [w for w in caught if "igamma" in str(w.message) and "ran on the CPU" in str(w.message)]
    assert len(cpu_warnings) == 1


def test_fallback_warnings_name_the_users_line(fresh):
    """Eager (through torch's dispatcher) and compiled (through dynamo's wrappers too), the
    warning is attributed to the line that called the op, as torch's own warnings are."""
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    x, k = torch.tensor([[0.5, 1.5, 2.0]]), torch.tensor([[2.0, 3.0, 1.0]])  # igamma stays on the CPU

    def f(a):
        return torch.igamma(k.to(a.device), a) * 2  # the line the compiled graph's warnings name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager_line = inspect.currentframe().f_lineno + 1
        r1 = torch.igamma(k.to("tt"), x.to("tt"))
        compiled_line = inspect.currentframe().f_lineno + 1
        r2 = torch.compile(f, backend="tt")(x.to("tt") + 1)
    assert torch.equal(r1.cpu(), torch.igamma(k, x)) and torch.equal(r2.cpu(), f(x + 1))
    where = {(w.filename, w.lineno) for w in caught
             if "ran on the CPU" in str(w.message) or "runs eagerly" in str(w.message)}
    assert where and all(filename == __file__ for filename, _ in where), where
    assert (__file__, eager_line) in where
    assert (__file__, compiled_line) in where or (__file__, f.__code__.co_firstlineno + 1) in where


def test_factories_on_tt_run_on_the_device(fresh):
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran on the CPU")
        assert torch.equal(torch.arange(5, device="tt").cpu(), torch.arange(5))
        assert torch.equal(torch.arange(0, 1, 0.25, device="tt").cpu(), torch.arange(0, 1, 0.25))
        assert torch.equal(torch.full((2, 3), 2.5, device="tt").cpu(), torch.full((2, 3), 2.5))
        assert torch.equal(torch.ones(2, 2, device="tt").cpu(), torch.ones(2, 2))
        assert torch.equal(nn.Transformer.generate_square_subsequent_mask(4, device="tt").cpu(),
                           nn.Transformer.generate_square_subsequent_mask(4))


def test_a_view_torch_refuses_is_refused_as_on_cpu(fresh):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible") as on_cpu:
        x.T.view(-1)
    with pytest.raises(RuntimeError, match="view size is not compatible") as on_tt:
        x.to("tt").T.view(-1)
    assert str(on_tt.value) == str(on_cpu.value)
    t = x.to("tt")
    assert t.view(2, 6).untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # an alias


def test_add_and_sub_with_alpha_one_are_one_device_op(fresh):
    # `a + b` (alpha defaults to 1), SGD momentum's `add_(grad, alpha=1 - dampening)` and
    # `addcmul(value=1)` multiply by nothing: one op each, which the device runs on its pages
    # with no intermediate buffer (a multiply by 1 had cost the loop thread 4x the op). Other
    # alphas are still applied, as device values. Values against CPU torch.
    from ttflow.torch import _eager

    a, b, c = (torch.randn(64, 64) for _ in range(3))
    ta, tb, tc = a.to("tt"), b.to("tt"), c.to("tt")
    _eager._entries.clear()
    cases = {
        "a + b": (lambda x, y, z: x + y, 1),
        "sub alpha=1": (lambda x, y, z: torch.sub(x, y, alpha=1), 1),
        "addcmul value=1": (lambda x, y, z: torch.addcmul(x, y, z, value=1), 2),
        "add alpha=2.5": (lambda x, y, z: torch.add(x, y, alpha=2.5), None),  # a multiply too
    }
    for name, (fn, ops) in cases.items():
        before = set(_eager._entries)
        got = fn(ta, tb, tc).cpu()
        want = fn(a, b, c)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        new = [_eager._entries[k] for k in set(_eager._entries) - before]
        assert len(new) == 1, name
        steps = new[0].binary.programs[0].steps
        assert len(steps) == ops if ops is not None else len(steps) > 1, (name, steps)


def test_queued_work_is_bounded_while_the_caller_never_waits(fresh, monkeypatch):
    """The loop thread leaves posted calls queued while the caller is busy posting (running
    them side by side would only make the two threads take turns at the GIL), but at
    MAX_QUEUED the caller waits for them and their device work, as CUDA's host does at a full
    launch queue: what is queued stays bounded however long a loop runs without a sync."""
    import importlib

    monkeypatch.setattr(importlib.import_module("ttflow.torch._session"), "MAX_QUEUED", 16)
    device = ttt.device()
    x = torch.ones(64, 64).to("tt")
    ttt.synchronize()
    before = device.stats.commands_run
    for _ in range(100):  # back to back, no pause: the loop thread would otherwise wait
        x = x + 1
    assert device.stats.commands_run - before >= 100 - 16
    assert torch.equal(x.cpu(), torch.full((64, 64), 101.0))


def test_posted_work_runs_once_the_caller_pauses(fresh):
    import time

    device = ttt.device()
    x = torch.ones(64, 64).to("tt")
    ttt.synchronize()
    before = device.stats.programs_run
    for _ in range(3):
        x = x * 2
    time.sleep(0.2)  # no call that waits: the loop thread sees the pause and runs them
    assert device.stats.programs_run - before == 3
    assert torch.equal(x.cpu(), torch.full((64, 64), 8.0))


def test_small_fills_share_a_device_constant_yet_stay_independent(fresh):
    """`ones_like`, `zeros_like`, `fill_` and `zero_` of small float tensors use one device
    constant per (shape, dtype, value), written once: `loss.backward()`'s seed gradient costs
    no program. Writing one of them in place never changes another."""
    device = ttt.device()
    a, b = torch.ones(2, 3, device="tt"), torch.ones(2, 3, device="tt")
    a.add_(1)
    c = torch.empty(2, 3, device="tt").fill_(1.0)
    d = torch.full((2, 3), 5.0, device="tt")
    d.zero_()
    assert torch.equal(a.cpu(), torch.full((2, 3), 2.0)) and torch.equal(b.cpu(), torch.ones(2, 3))
    assert torch.equal(c.cpu(), torch.ones(2, 3)) and torch.equal(d.cpu(), torch.zeros(2, 3))
    loss = (torch.randn(4, 4).to("tt").requires_grad_() * 2).sum()
    ttt.synchronize()
    before = device.stats.programs_run
    seed = torch.ones_like(loss)
    ttt.synchronize()
    assert device.stats.programs_run == before
    assert seed.cpu().item() == 1.0
    big = torch.ones(100, 100, device="tt")  # beyond the constants' size: a program fills it
    assert big.sum().item() == 10000.0


def test_a_cached_constant_is_never_handed_to_another_device(fresh):
    """A closed device's id may be reused by the next one: a cache entry answers only for its
    own device object."""
    cache = _storage._Constants(4)
    device = ttt.device()
    first = cache.get("k", device, lambda: torch.ones(1, 1))
    assert cache.get("k", device, lambda: torch.zeros(1, 1)) is first
    ttt.close()
    ttt.open_device()
    other = ttt.device()
    cache._entries[(id(other), "k")] = (device, first)  # as if the new device had the old id
    fresh_cell = cache.get("k", other, lambda: torch.full((1, 1), 3.0))
    assert fresh_cell is not first
    assert session.call(lambda: fresh_cell.get().device) is other


def test_threads_running_ops_at_once_leak_nothing_and_trace_one_at_a_time(fresh, monkeypatch):
    """Every thread that makes a tt tensor drains the storages torch freed, and traces the
    programs of calls it is the first to make. Three threads doing so at once must drop every
    freed storage's value (a shared drain buffer read by one thread after another had refilled
    it lost addresses: their device values stayed allocated), and must leave torch as it was
    (make_fx patches nn.Module.__call__ while it traces; two traces at once left it patched)."""
    import importlib
    import threading

    monkeypatch.setattr(importlib.import_module("ttflow.torch._session"), "MAX_QUEUED", 16)
    module_call = nn.Module.__call__
    results = {}
    start = threading.Barrier(3)

    def work(k):
        x = torch.zeros(32, 32 + k).to("tt")
        start.wait()  # each thread's first calls are new signatures: traced at the same time
        for i in range(300):
            x = (x + 1) * 1.0 - 0.0
            if i % 100 == 0:
                gc.collect()
        results[k] = x.sum().item()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert nn.Module.__call__ is module_call
    assert results == {k: 300.0 * 32 * (32 + k) for k in range(3)}
    gc.collect()
    ttt.synchronize()
    assert _storage.live_slots() == 0
