"""What stays on the device by the user's choice: `no_offload()` in the model's code, or
`no_offload_in(module)` without touching it. The trace counts saved tensors as the runtime does,
so a tuned plan is followed in both."""

import logging

import pytest
import torch
import torch.nn as nn

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.core.keep import offload_blocked, submodules
from lms.core.plan import Plan
from lms.core.units import format_bytes
from lms.planning import plan_auto
from lms.planning.candidates import Candidates
from tests.conftest import assert_bitwise, assert_followed, midway_budget, run_step


def _block():
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())


class Stack(nn.Module):
    def __init__(self, edited=False, fail=False):
        super().__init__()
        self.a, self.b, self.c = _block(), _block(), _block()
        self.edited = edited
        self.fail = fail

    def forward(self, x):
        x = self.a(x)
        if self.edited:
            with lms.no_offload():
                x = self.b(x)
        else:
            x = self.b(x)
        if self.fail:
            raise RuntimeError("failed mid-forward")
        return self.c(x)


def _step(model, batch):
    loss = model(*batch).float().square().mean()
    loss.backward()
    return loss


def _model(edited=False):
    torch.manual_seed(0)
    return Stack(edited), [torch.randn(2048, 256)]


def _tuned_steps(model, inputs, tmp_path, caplog):
    """Two planned steps, bitwise with the plain one, each following its plan."""
    ref = run_step(model, inputs)
    trace = trace_step(model, inputs, _step, device="cpu")
    spec = device_spec("cpu")
    budget = midway_budget(trace, spec)
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=str(tmp_path))
    plan = offload.tune(model, inputs, _step)
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, run_step(model, inputs, offload))
    assert "saves tensors other than" not in caplog.text
    assert_followed(plan, offload.stats, steps=2)
    offload.close()
    return trace, offload.stats


def test_a_tuned_plan_counts_no_offload_regions_as_the_runtime_does(tmp_path, caplog):
    plain_trace, plain = _tuned_steps(*_model(), tmp_path, caplog)
    trace, stats = _tuned_steps(*_model(edited=True), tmp_path, caplog)
    # b's linear layers and tanh save 2 MiB activations; all stay, traced and at run time
    assert len(trace.entries()) < len(plain_trace.entries())
    assert stats.kept_tensors > plain.kept_tensors


def test_no_offload_in_keeps_a_module_without_editing_it(tmp_path, caplog):
    edited_trace, edited = _tuned_steps(*_model(edited=True), tmp_path, caplog)
    model, inputs = _model()
    with lms.no_offload_in(model.b) as kept:
        trace, stats = _tuned_steps(model, inputs, tmp_path, caplog)
        assert not offload_blocked()  # only while b runs
    assert kept is not None
    assert trace.entries() == edited_trace.entries()  # the same choice as the edited model's
    assert stats.kept_tensors == edited.kept_tensors
    assert not model.b._forward_pre_hooks and not model.b._forward_hooks  # hooks removed


def test_an_exception_inside_a_kept_module_leaves_nothing_blocked(tmp_path):
    torch.manual_seed(0)
    model = Stack(fail=True)
    offload = lms.LMS(swapout_threshold=1, tier="disk", spill_dir=str(tmp_path))
    with lms.no_offload_in(model.b), pytest.raises(RuntimeError, match="mid-forward"), offload:
        model(torch.randn(64, 256))
    assert not offload_blocked()
    model.fail = False
    run_step(model, [torch.randn(2048, 256)], offload)
    assert offload.stats.offloaded_tensors > 0
    offload.close()


def test_bad_modules_and_names_are_typed_errors():
    model, _ = _model()
    with pytest.raises(TypeError, match="takes modules"):
        lms.no_offload_in("b")
    assert submodules(model, ["b", "c.0"]) == (model.b, model.c[0])
    with pytest.raises(ValueError, match=r"no submodule 'd'; its top-level ones: a, b, c"):
        submodules(model, ["d"])


def test_moving_a_storage_a_kept_save_holds_frees_nothing_in_the_simulator():
    model, inputs = _model(edited=True)
    trace = trace_step(model, inputs, _step, device="cpu")
    ordinal = {storage: i for i, (storage, _, _) in enumerate(trace.entries())}
    held = {ordinal[storage] for storage in trace.held}
    assert held  # b's input and output: saved in a (or c) too

    def peak(offload):
        plan = Plan(
            fingerprint=trace.fingerprint(),
            offload=tuple(sorted(offload)),
            num_entries=len(ordinal),
        )
        return simulate(trace, plan, device_spec("cpu")).peak_bytes

    everything = set(range(len(ordinal)))
    assert peak(everything) >= peak(everything - held)  # brought back, they are copies more
    # so no plan moves them, nor the input (held by the caller since before the step)
    inputs = {i for storage, i in ordinal.items() if trace.storages[storage].alloc_op < 0}
    assert inputs
    checker = Candidates(trace, device_spec("cpu"), budget_bytes=2**40)
    asked = checker.plan(everything, recompute=everything, source="test")
    assert checker.pinned == held | inputs
    assert set(asked.recompute) == everything - held - inputs and not asked.offload
    budget = int(simulate(trace, None, device_spec("cpu")).peak_bytes * 0.85)
    plan = plan_auto(trace, device_spec("cpu"), budget)
    assert plan.offload and not (held | inputs) & {*plan.offload, *plan.recompute}


@pytest.mark.parametrize("policy", ["budget", "threshold"])
def test_without_a_plan_a_storage_a_kept_save_holds_stays_from_the_second_step(policy, tmp_path):
    model, inputs = _model(edited=True)
    ref = run_step(model, inputs)
    trace = trace_step(model, inputs, _step, device="cpu")
    assert trace.held  # b's input and output, saved in a and c too
    setting = {"budget": "1MiB"} if policy == "budget" else {"swapout_threshold": 1}
    offload = lms.LMS(**setting, tier="disk", spill_dir=str(tmp_path))
    moved = []
    for _ in range(3):
        before = offload.stats.offloaded_tensors
        assert_bitwise(ref, run_step(model, inputs, offload))
        moved.append(offload.stats.offloaded_tensors - before)
    # the first step learns only after it moved them which storages kept saves hold, and which
    # the caller holds: the input, and the output (saved by the last Tanh) that run_step keeps
    storages = [storage for storage, _, _ in trace.entries()]
    inputs = {s for s in storages if trace.storages[s].alloc_op < 0}
    assert len(inputs) == 1 and storages[-1] not in trace.held | inputs
    held = trace.held | inputs | {storages[-1]}
    assert moved[1] == moved[2] == len(storages) - len(held) < moved[0]
    assert offload.plan is None
    offload.close()


@pytest.mark.parametrize("caller_holds", [True, False])
def test_without_a_plan_what_the_caller_holds_stays_from_the_second_step(caller_holds, tmp_path):
    model, (x,) = _model()
    offload = lms.LMS(budget="1MiB", tier="disk", spill_dir=str(tmp_path))
    moved, losses = [], []
    for _ in range(3):
        before = offload.stats.offloaded_tensors
        batch = x if caller_holds else x.clone()  # cloned: autograd's save is the only holder
        with offload:
            loss = _step(model, [batch])
            del batch
        losses.append(loss.item())
        moved.append(offload.stats.offloaded_tensors - before)
    saved = 7  # the input and the six Tanh outputs (each read again by the next Linear)
    if caller_holds:  # moving the input freed nothing: from the second step it stays
        assert moved == [saved, saved - 1, saved - 1]
    else:
        assert moved == [saved] * 3
    assert losses[0] == losses[1] == losses[2]
    offload.close()


@pytest.mark.parametrize("named", [False, True])
def test_without_a_plan_a_cpu_budget_starts_from_the_model_and_its_batch(named, tmp_path, caplog):
    """Note [What a budget on the CPU starts from]: the models the runtime knows, else the first
    module the step calls with the tensors it is given; a tied weight counted once. The first
    step says how the budget divides."""
    torch.manual_seed(0)
    first, last = nn.Linear(64, 64), nn.Linear(64, 64)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), last)
    x = torch.randn(256, 64)
    known = {"model": model} if named else {}
    offload = lms.LMS(budget="64MiB", min_offload_bytes=0, spill_dir=str(tmp_path), **known)
    with caplog.at_level(logging.INFO, logger="lms"):
        run_step(model, (x,), offload)
    weights = (64 * 64 + 2 * 64) * 4  # one weight, two biases
    start = weights + (0 if named else x.numel() * 4)
    assert offload._step.baseline_bytes == start
    said = f"the budget of 64.00 MiB holds {format_bytes(start)} that the step started from"
    assert said in caplog.text
