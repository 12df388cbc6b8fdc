"""The order of copies on a CUDA device's two streams, played on the CPU with a stand-in copy
engine: a copy in waits for the copy out of the same data (Note [A copy in follows the copy out
of its data]). `tests/gpu/test_cuda.py` checks the bits on a card."""

import torch

from lms.runtime.store import Entry, Offloader


class CopyOut:
    """A copy out's event, still running until ``synchronize``."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class Engine:
    """Records what each copy in was queued after."""

    def __init__(self):
        self.after = []

    def copy_in(self, src, into=None, *, after=None):
        self.after.append(after)
        return src.clone(), object()


def _offloaded(offloader):
    data = torch.arange(256, dtype=torch.uint8)
    entry = Entry(0, 0, data.untyped_storage(), torch.device("cuda"))  # no CUDA call made
    entry.offloaded, entry.host_buf, entry.pending_out = True, data.clone(), CopyOut()
    offloader._pending.append(entry)
    return entry


def test_a_copy_in_queued_while_its_copy_out_runs_waits_for_it():
    offloader = Offloader(tier="host", host_limit_bytes=2**20, spill_dir=None, sync_out=False)
    engine = Engine()
    offloader._engines[torch.device("cuda")] = engine
    entry = _offloaded(offloader)
    copy_out = entry.pending_out
    assert offloader.prefetch(entry)
    assert engine.after == [copy_out]
    assert entry.storage is not None  # backward reads the device storage until it is seen done


def test_a_copy_in_after_its_copy_out_was_seen_done_waits_for_nothing():
    offloader = Offloader(tier="host", host_limit_bytes=2**20, spill_dir=None, sync_out=False)
    engine = Engine()
    offloader._engines[torch.device("cuda")] = engine
    entry = _offloaded(offloader)
    offloader.wait_oldest()
    assert entry.pending_out is None and entry.storage is None
    assert offloader.prefetch(entry)
    assert engine.after == [None]


def test_each_device_has_its_own_streams(monkeypatch):
    # a model split over two devices in one process: each tensor is copied on its own device's
    # streams, and a copy in allocates there
    import lms.runtime._cuda

    made = []

    class Streams:
        def __init__(self, device):
            self.device = device
            made.append(device)

    monkeypatch.setattr(lms.runtime._cuda, "CopyEngine", Streams)
    offloader = Offloader(tier="host", host_limit_bytes=2**20, spill_dir=None, sync_out=False)
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    engines = [offloader._engine_for(d) for d in (first, second, first, second)]
    assert [engine.device for engine in engines] == [first, second, first, second]
    assert made == [first, second]


def test_backward_lets_go_of_device_storages_whose_copies_out_finished(monkeypatch, spill_dir):
    """Forward's last copies out may still run when backward starts; once one has finished, the
    next read in backward drops that device storage (as the simulator frees it, at the copy's
    end), rather than keeping it until backward reads it."""
    import threading

    import lms
    from lms.runtime.disk import SpillStore

    gate = threading.Event()
    write = SpillStore._write

    def held_back(self, path, data):  # the copies out finish only once backward has begun
        gate.wait(10)
        write(self, path, data)

    monkeypatch.setattr(SpillStore, "_write", held_back)
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(64, 256)
    seen = []
    offload = lms.LMS(tier="disk", swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    with offload:
        late = model[:10](x)
        loss = model[10:](late).square().mean()
        pending = list(offload._offloader._pending)
        assert len(pending) > 4 and all(e.storage is not None for e in pending)
        gate.set()
        for entry in pending:
            entry.pending_out.result()
        # runs once the last layer has read what it saved, before the early layers' turn
        late.register_hook(lambda grad: seen.append([e.storage is None for e in pending]))
        loss.backward()
    assert seen and all(seen[0]), seen
    offload.close()


def test_a_wait_for_a_copy_out_is_a_wait_of_the_step_record():
    """The runtime waits for the oldest copy out while the copies in flight would take the step
    past its budget; a record counts that as a wait (on a card, the host stood still and the
    compute stream ran dry), and one already finished as none."""
    from lms.runtime.steplog import StepLog

    offloader = Offloader(tier="host", host_limit_bytes=2**20, spill_dir=None, sync_out=False)
    log = StepLog(torch.device("cpu"))
    offloader.record_to(log)
    running = _offloaded(offloader)
    done = _offloaded(offloader)
    done.ordinal = 1
    done.pending_out.done = True
    log.begin(1, {})
    offloader.wait_oldest()
    offloader.wait_oldest()
    log.end({})
    (step,) = log.steps
    assert [wait.ordinal for wait in step.waits] == [running.ordinal]
    assert running.pending_out is None and done.pending_out is None
