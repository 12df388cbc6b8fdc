"""A traced step that uses tensors from outside the model and batch: a GradScaler's scale, a
frozen teacher's weights, a tensor a module caches."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torchvision

import lms
from lms.analysis import device_spec, trace_step
from tests.conftest import (
    assert_bitwise,
    midway_budget,
    recomputing_plan,
    run_step,
    tuned_cpu_spec,
)


def _student(hidden=1):
    torch.manual_seed(0)
    inner = [m for _ in range(hidden) for m in (nn.Linear(512, 512), nn.Tanh())]
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), *inner, nn.Linear(512, 8))


def test_a_scaler_made_lazily_in_the_trace_is_refused_naming_it():
    scaler = torch.amp.GradScaler("cpu")  # its scale is made at its first use

    def step(model, batch):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch[0]).float().square().mean()
        scaler.scale(loss).backward()

    with pytest.raises(lms.StepStateError, match="GradScaler._scale") as caught:
        lms.LMS(budget="1GiB").tune(_student(), [torch.randn(64, 64)], step)
    assert "GradScaler._growth_tracker" in caught.value.holders
    assert "before tune" in str(caught.value)


class Caches(nn.Module):
    """Keeps its last output for a metric, and fills a list its blocks share, as MONAI's DynUNet
    does with its deep-supervision heads (Note [A module's cache is put back])."""

    def __init__(self):
        super().__init__()
        self.heads = [torch.zeros(1)]
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        for block in self.blocks:
            block.heads = self.heads  # one list, which every block holds

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
            block.heads[0] = x
        self.last = x.detach()  # made by the first step
        return x + self.heads[0]


def test_a_modules_cache_is_put_back_and_the_plan_is_bitwise(tmp_path):
    torch.manual_seed(0)
    model, x = Caches(), torch.randn(256, 64)
    original = model.heads[0]
    trace = trace_step(model, [x], device="cpu", min_offload_bytes=0)
    assert not hasattr(model, "last")
    assert model.heads[0] is original and model.blocks[1].heads is model.heads

    def mean(out):  # the loss the trace took (`lms.analysis.trace.default_step`)
        return out.float().mean()

    ref = run_step(model, [x], loss_fn=mean)
    offload = lms.LMS(
        plan=recomputing_plan(trace), tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0
    )
    for _ in range(2):
        assert_bitwise(ref, run_step(model, [x], offload, loss_fn=mean))
    assert offload.stats.offloaded_tensors and not offload.stats.diverged_steps
    offload.close()


def test_a_traced_step_leaves_no_fake_tensor_behind():
    import gc

    from torch._subclasses.fake_tensor import FakeTensor

    def alive():  # what earlier tests left may go meanwhile: only new ones count
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is FakeTensor}

    before = alive()
    model = torchvision.models.resnet18(num_classes=10)
    trace = trace_step(model, [torch.randn(2, 3, 64, 64)], device="cpu", min_offload_bytes=0)
    assert trace.junctions  # hooked on autograd's nodes while backward ran
    assert not alive() - before


def test_a_scaler_and_a_teacher_from_outside_trace_and_follow_the_plan(tmp_path, caplog):
    # Three hidden layers: a half-precision matrix product on a CPU takes megabytes of scratch
    # (its operands widened), measured where the tune times it, and with one hidden layer the
    # step peaks where nothing saved can leave, so no budget below its peak fits.
    student, x = _student(hidden=3), torch.randn(2048, 64)
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).requires_grad_(False)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # its state made before tune

    def step(model, batch):
        with torch.no_grad():
            target = teacher(batch[0])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(batch[0]).float() - target).square().mean()
        scaler.scale(loss).backward()
        return loss.detach()

    def run(ctx=None):
        student.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = step(student, [x])
        return loss, [p.grad.clone() for p in student.parameters()]

    ref = run()
    trace = trace_step(student, [x], step, device="cpu")
    budget = midway_budget(trace, tuned_cpu_spec(trace))  # the scratch the tune measures
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=str(tmp_path))
    plan = offload.tune(student, [x], step)
    assert plan.offload or plan.recompute
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, run(offload))
    assert "[LMS] step" not in caplog.text
    assert type(scaler._scale) is torch.Tensor  # still real
    offload.close()


def test_a_share_whose_floor_measured_scratch_puts_over_its_peak_is_refused_saying_so():
    from lms.analysis import simulate
    from lms.planning.candidates import Candidates
    from lms.planning.minimum import smallest_plan

    student, x = _student(), torch.randn(2048, 64)

    def step(model, batch):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch[0]).float().square().mean()
        loss.backward()
        return loss.detach()

    trace = trace_step(student, [x], step, device="cpu")
    timed = tuned_cpu_spec(trace)
    _, everything_out = smallest_plan(Candidates(trace, timed, budget_bytes=2**40, half=True))
    if everything_out.peak_bytes <= simulate(trace, None, device_spec("cpu"), half=True).peak_bytes:
        pytest.skip("this CPU's half-precision matrix products take little scratch")
    with pytest.raises(lms.PlanInfeasibleError, match="give the budget in bytes, at least"):
        lms.LMS(budget="85%").tune(student, [x], step)


class _Recurrent(nn.Module):
    """Stacked LSTMs whose state the step carries to the next batch (truncated backpropagation
    through time)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.LSTM(16 if i == 0 else 32, 32, batch_first=True) for i in range(3)
        )
        self.head = nn.Linear(32, 16)

    def forward(self, x, state):
        carried = []
        for i, layer in enumerate(self.layers):
            x, kept = layer(x, None if state is None else state[i])
            x = torch.tanh(x)
            carried.append(tuple(t.detach() for t in kept))
        return self.head(x), carried


_state = None  # the state a step carries, as a script keeps it in a global


def _backward(model, batch, state):
    out, state = model(batch[0], state)
    loss = (out - batch[1]).square().mean()
    loss.backward()
    return loss.detach(), state


def _global_step(model, batch):
    global _state
    loss, _state = _backward(model, batch, _state)
    return loss


def _closed_step():
    state = None

    def step(model, batch):
        nonlocal state
        loss, state = _backward(model, batch, state)
        return loss

    return step, lambda: state


class _Carrier:
    """A training loop's object whose method is the step, the state on itself."""

    def __init__(self):
        self.state = None

    def step(self, model, batch):
        loss, self.state = _backward(model, batch, self.state)
        return loss


@pytest.mark.parametrize("kept", ["global", "closure", "method"])
def test_a_state_the_step_carries_is_bound_again_after_tune(tmp_path, kept):
    """Note [A module's cache is put back]: tracing the step bound its global (or the variable
    it closes over) to fake tensors; tune raised StepStateError. It is bound again to what it
    was, and the tuned steps carry the real state as the plain steps do."""
    global _state
    torch.manual_seed(2)
    batches = [[torch.randn(4, 120, 16), torch.randn(4, 120, 16)] for _ in range(3)]

    def run(model, step, ctx=None):
        got = []
        for batch in batches:
            model.zero_grad(set_to_none=True)
            with ctx if ctx is not None else contextlib.nullcontext():
                loss = step(model, batch)
            got.append((loss, [p.grad.clone() for p in model.parameters()]))
        return got

    if kept == "global":
        _state = None
        ref = run(_Recurrent(), _global_step)
        _state, step, state = None, _global_step, lambda: _state
    elif kept == "closure":
        ref = run(_Recurrent(), _closed_step()[0])
        step, state = _closed_step()
    else:
        ref = run(_Recurrent(), _Carrier().step)
        carrier = _Carrier()
        step, state = carrier.step, lambda: carrier.state
    model = _Recurrent()
    trace = trace_step(model, batches[0], step, device="cpu")
    assert state() is None
    offload = lms.LMS(
        budget=midway_budget(trace, device_spec("cpu")), tier="disk", spill_dir=str(tmp_path)
    )
    plan = offload.tune(model, batches[0], step)
    assert state() is None and (plan.offload or plan.recompute)
    for want, got in zip(ref, run(model, step, offload), strict=True):
        assert_bitwise(want, got)
    assert type(state()[0][0]) is torch.Tensor and offload.stats.diverged_steps == 0
    offload.close()


_history: list[torch.Tensor] = []  # filled in place by the step: nothing rebinds it


def test_a_list_the_step_fills_in_place_is_refused_naming_it():
    def step(model, batch):
        out = model(batch[0])
        _history.append(out.detach())
        out.square().mean().backward()

    with pytest.raises(lms.StepStateError, match=r"test_outside_state\._history\[0\]"):
        lms.LMS(budget="1GiB").tune(_student(), [torch.randn(64, 64)], step)
    _history.clear()


def test_a_saved_output_backward_never_reaches_leaves_no_state():
    def step(model, batch):
        hidden = model[0](batch[0])
        hidden.tanh()  # saves its own output, which backward never reaches
        model[2](hidden.relu()).sum().backward()

    trace = trace_step(_student(), [torch.randn(32, 64)], step, device="cpu")
    assert any(op.name == "aten.tanh.default" for op in trace.ops)


def test_a_step_without_backward_is_refused():
    with pytest.raises(lms.UnplannableStepError, match="ran no backward"):
        lms.LMS(budget="1GiB").tune(_student(), [torch.randn(32, 64)], lambda m, b: m(b[0]).sum())
