"""The host pool pins what it counts, no more, and unpins what it drops (Note [Pinned to the
byte]); a CUDA device's pool is played on the CPU with page-locking recorded instead of done."""

import ctypes
import gc

import pytest
import torch
import torch.nn as nn

import lms
from lms.runtime import pool, store
from tests.conftest import assert_bitwise, hooks_are_gone, run_step

MiB = 1024**2


class PinnedPool(pool.HostPool):
    """A CUDA device's pool, on the CPU."""

    def __init__(self, limit_bytes, *, pin):
        super().__init__(limit_bytes, pin=True)


@pytest.fixture
def locked(monkeypatch):
    """Addresses page-locked by registration, with their sizes, while a test runs."""
    held: dict[int, int] = {}

    def pin_host(nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        assert buf.data_ptr() not in held
        held[buf.data_ptr()] = nbytes
        return buf

    def unpin(buf):
        assert held.pop(buf.data_ptr()) == buf.numel()

    monkeypatch.setattr(pool, "pin_host", pin_host)
    monkeypatch.setattr(pool, "unpin_host", unpin)
    yield held


def test_a_pinned_pool_locks_exactly_its_buckets_and_unlocks_what_it_trims(locked):
    # 5 MiB + 1 byte sits in a 6 MiB bucket; PyTorch's pinned allocator would pin 8 MiB for it,
    # and keep pinned each buffer trimmed to make room for another size.
    host = pool.HostPool(20 * MiB, pin=True)
    sizes = [5 * MiB + 1, 3 * MiB, 9 * MiB, 5 * MiB + 1, 17 * MiB, 2 * MiB + 7, 11 * MiB]
    for nbytes in sizes:
        buf = host.acquire(nbytes)
        assert buf is not None and buf.numel() == pool.bucket_bytes(nbytes) >= nbytes
        assert sum(locked.values()) == host.allocated_bytes == host.registered_bytes
        assert host.allocated_bytes <= host.limit_bytes
        host.release(buf)
    assert sorted(locked.values()) != sorted(pool.bucket_bytes(n) for n in sizes)  # trimmed some
    host.clear()
    assert locked == {} and host.allocated_bytes == 0


def test_buffers_up_to_2_mib_come_from_pytorch_and_are_not_registered(locked, monkeypatch):
    made = []
    monkeypatch.setattr(pool, "_empty", lambda n, pin: made.append((n, pin)) or torch.empty(n))
    host = pool.HostPool(64 * MiB, pin=True)
    host.release(host.acquire(2 * MiB))
    host.release(host.acquire(1000))
    assert made == [(2 * MiB, True), (1024, True)] and locked == {}
    assert host.registered_bytes == 0
    host.clear()


def test_a_pool_that_goes_unpins_the_buffers_it_lent(locked):
    host = pool.HostPool(64 * MiB, pin=True)
    lent = host.acquire(4 * MiB)
    host.release(host.acquire(8 * MiB))
    assert len(locked) == 2
    del host
    gc.collect()
    assert locked == {}
    lent.fill_(1)  # unlocked, and still the lender's memory while referenced


def test_a_refused_registration_is_a_full_budget(locked, monkeypatch):
    # Note [Pinning can fail below the budget], for a buffer above 2 MiB: the runtime's call
    # returns None where CUDA answers cudaErrorMemoryAllocation.
    pin_host = pool.pin_host
    monkeypatch.setattr(pool, "pin_host", lambda n: pin_host(n) if not locked else None)
    host = pool.HostPool(64 * MiB, pin=True)
    first = host.acquire(4 * MiB)
    assert first is not None and host.acquire(4 * MiB) is None
    assert host.limit_bytes == 4 * MiB and len(locked) == 1
    host.release(first)
    assert host.acquire(4 * MiB) is first  # the one pinned is reused
    host.clear()


def test_a_host_that_cannot_register_pins_through_pytorch(locked, monkeypatch, caplog):
    def unsupported(nbytes):
        raise torch.cuda.CudaError(801)  # cudaErrorNotSupported

    made = []
    monkeypatch.setattr(pool, "pin_host", unsupported)
    monkeypatch.setattr(pool, "_empty", lambda n, pin: made.append((n, pin)) or torch.empty(n))
    host = pool.HostPool(64 * MiB, pin=True)
    with caplog.at_level("WARNING", logger="lms"):
        bufs = [host.acquire(6 * MiB), host.acquire(10 * MiB)]
    assert all(buf is not None for buf in bufs) and made == [(6 * MiB, True), (10 * MiB, True)]
    assert caplog.text.count("page-locking host memory in place failed") == 1  # tried once
    assert host.registered_bytes == 0
    for buf in bufs:
        host.release(buf)
    host.clear()


def test_a_buffer_the_host_could_not_hold_beside_2_gib_is_not_pinned(locked, monkeypatch):
    # Note [Pinning can fail below the budget]: faulting its pages in would wake the kernel's
    # out-of-memory killer, so it is refused as CUDA would refuse it, within the host budget.
    available = [64 * 1024 * MiB]
    monkeypatch.setattr(pool, "available_host_bytes", lambda: available[0])
    host = pool.HostPool(64 * 1024 * MiB, pin=True)
    first = host.acquire(8 * MiB)
    available[0] = 2048 * MiB + 7 * MiB  # less than a second 8 MiB buffer and the reserve
    assert first is not None and host.acquire(8 * MiB) is None
    assert host.limit_bytes == 8 * MiB and len(locked) == 1
    host.release(first)
    host.clear()


def test_a_step_on_a_pinned_pool_leaves_nothing_pinned(locked, monkeypatch, spill_dir):
    monkeypatch.setattr(store, "HostPool", PinnedPool)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh())
    inputs = (torch.randn(1536, 1024),)  # 6 MiB activations
    ref = run_step(model, inputs)
    offload = lms.LMS(tier="host", spill_dir=spill_dir, swapout_threshold=1)
    offload._offloader.tier = "auto-host"  # a CUDA-like auto tier, host then disk
    peak = []
    for _ in range(2):
        assert_bitwise(ref, run_step(model, inputs, offload))
        peak.append(sum(locked.values()))
    pooled = offload._offloader._pool
    assert peak[0] == peak[1] == pooled.allocated_bytes  # reused, not pinned again
    assert pooled.allocated_bytes >= pooled.peak_in_use_bytes >= 2 * 6 * MiB
    assert pooled.allocations == len(locked)
    offload.close()
    assert locked == {} and hooks_are_gone()


def test_the_simulator_counts_host_memory_as_the_pool_takes_it(locked, monkeypatch):
    """On a GPU spec each offloaded copy is counted in its pool bucket, so a plan's host peak
    (what spill placement and the host budget check read) is what the pinned pool holds."""
    from lms.analysis import device_spec, simulate, trace_step
    from tests.runtime.test_junctions import _everything_out

    monkeypatch.setattr(store, "HostPool", PinnedPool)
    monkeypatch.setattr(pool, "_empty", lambda n, pin: torch.empty(n, dtype=torch.uint8))

    def build():
        torch.manual_seed(0)
        widths = [1024, 1024, 2600, 1024]  # copies of 1.17 and 2.98 MiB: 2 and 4 MiB buckets
        layers = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers)

    inputs = (torch.randn(300, 1024),)
    trace = trace_step(build, inputs, device="cpu", min_offload_bytes=0)
    plan = _everything_out(trace)
    exact = sum(nbytes for _, nbytes, _ in trace.entries())
    simulated = simulate(trace, plan, device_spec("h100")).host_peak_bytes
    assert simulated == sum(pool.bucket_bytes(n) for _, n, _ in trace.entries()) > 1.5 * exact
    assert simulate(trace, plan, device_spec("cpu")).host_peak_bytes == exact  # spill files
    model = build()
    ref = run_step(model, inputs)
    offload = lms.LMS(plan=plan, tier="host", min_offload_bytes=0)
    offload._offloader.tier = "auto-host"  # a CUDA-like auto tier, host then disk
    for _ in range(2):
        assert_bitwise(ref, run_step(model, inputs, offload))
    assert offload._offloader.pool.peak_in_use_bytes == simulated
    offload.close()


@pytest.mark.parametrize("bindings", [True, False])  # cuda.bindings' runtime, PyTorch's
@pytest.mark.parametrize("code", [0, 2, 1])  # success, cudaErrorMemoryAllocation, another
def test_pin_host_locks_whole_pages_and_answers_a_refusal(monkeypatch, code, bindings):
    """Note [Host registration through cuda.bindings]: either runtime locks whole pages, and a
    refusal resets that runtime's last error, so that PyTorch's next kernel launch cannot see it."""
    from lms.runtime import _cuda

    calls, resets = [], []

    def register(ptr, nbytes, flags):
        calls.append((ptr, nbytes, flags))
        return (code,) if bindings else code

    class Bindings:  # cuda.bindings.runtime, answering `code`
        cudaHostRegisterPortable = 1
        cudaHostRegister = staticmethod(register)

        @staticmethod
        def cudaGetLastError():
            resets.append(code)
            return (code,)

    class Torch:  # torch.cuda.cudart(), answering `code`
        cudaHostRegister = staticmethod(register)

    monkeypatch.setattr(_cuda._Runtime, "_chosen", _cuda._Runtime(Bindings if bindings else None))
    monkeypatch.setattr(torch.cuda, "cudart", Torch)
    if not bindings:
        monkeypatch.setattr(_cuda, "_loaded", lambda name: [])
        monkeypatch.setattr(ctypes, "CDLL", lambda library: Bindings)
    nbytes = 6 * MiB
    if code == 1:
        with pytest.raises(torch.cuda.CudaError):
            _cuda.pin_host(nbytes)
    else:
        buf = _cuda.pin_host(nbytes)
        assert (buf is None) == (code != 0)
        if buf is not None:
            assert (buf.data_ptr(), buf.numel()) == calls[0][:2]
            # is_pinned() asks the driver about the storage's first byte: the registered one
            assert buf.untyped_storage().data_ptr() == buf.data_ptr()
    ptr, size, flags = calls[0]
    assert ptr % 4096 == 0 and size == nbytes and flags == 1  # portable: for every device
    assert resets == ([] if code == 0 else [code])  # the next kernel launch must not see it


def test_cuda_bindings_serve_only_where_their_runtime_reaches_a_device(monkeypatch):
    """Here no driver answers: registration falls back to PyTorch's binding."""
    from lms.runtime import _cuda

    pytest.importorskip("cuda.bindings")
    if torch.cuda.is_available():
        pytest.skip("a device answers here")
    monkeypatch.setattr(_cuda._Runtime, "_chosen", None)
    assert _cuda._Runtime.get().bindings is None
