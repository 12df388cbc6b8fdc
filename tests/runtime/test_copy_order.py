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


def test_a_step_that_follows_its_plan_checks_its_budget_where_the_simulator_does(
    spill_dir, monkeypatch
):
    """Note [The budget's wait follows the simulator]: following its plan, the runtime checks
    whether the copies out in flight take it past its budget after the saves it copies out, as
    the simulator does, not after those it keeps or recomputes; without a plan, after each."""
    import lms
    from lms.analysis import trace_step
    from lms.runtime.session import Session
    from tests.conftest import assert_bitwise, recomputing_plan, run_step

    torch.manual_seed(0)
    layers = []
    for c in (3, 8, 8, 8):
        layers += [torch.nn.Conv2d(c, 8, 3, padding=1), torch.nn.ReLU()]
    model, x = torch.nn.Sequential(*layers), torch.randn(1, 3, 32, 32)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    checked = []
    evict = Session._evict
    monkeypatch.setattr(Session, "_evict", lambda self, s: checked.append(1) or evict(self, s))
    trace = trace_step(model, [x], step, device="cpu", min_offload_bytes=0)
    plan = recomputing_plan(trace)
    assert plan.offload and plan.recompute
    ref = run_step(model, (x,))
    offload = lms.LMS(
        plan=plan, budget="1GiB", tier="disk", spill_dir=spill_dir, min_offload_bytes=0
    )
    assert_bitwise(ref, run_step(model, (x,), offload))
    assert len(checked) == len(plan.offload) < plan.num_entries
    checked.clear()
    policy = lms.LMS(budget="1GiB", tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    run_step(model, (x,), policy)
    assert len(checked) == plan.num_entries


def test_a_cards_budget_starts_from_what_was_allocated_as_the_step_began(monkeypatch):
    """Note [What a budget on the CPU starts from]: on a card, what the step began with (read as
    it began), not what is allocated at its first save, which may hold that op's output too."""
    import lms
    from lms.runtime.step import Step

    runtime = lms.LMS(budget="1GiB")
    step = Step(1, None)
    step.entered = (0, 100, 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 300)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert runtime._baseline(step, torch.device("cuda", 0)) == 100
    assert runtime._baseline(step, torch.device("cuda")) == 100
    assert runtime._baseline(step, torch.device("cuda", 1)) == 300  # another card: read then
