"""The mixed-integer planner (Note [The choice as a mixed-integer program]): its memory picture is
the simulator's without offload, the runtime follows its plans bitwise, and without scipy it
names the extra. How near its plans come to the best there is: tests/planning/test_planners.py."""

import importlib.util

import numpy
import pytest
import torch

import lms
from lms.analysis import simulate, trace_step
from lms.core.extras import MissingExtraError
from lms.planning.candidates import Candidates
from lms.planning.milp import _Program, plan_milp
from tests.conftest import assert_bitwise, run_step
from tests.planning.test_planners import Branches, Chain, Skips, small_spec, trace_of

pytest.importorskip("scipy")


@pytest.mark.parametrize("model_cls", [Chain, Skips, Branches])
def test_the_memory_picture_without_offload_is_the_simulators(model_cls):
    trace, spec = trace_of(model_cls), small_spec()
    plain = simulate(trace, None, spec)
    program = _Program(Candidates(trace, spec, 1), half=False, plain=plain)
    memory = program.base.copy()
    for ordinal in numpy.nonzero(program.movable)[0]:
        memory[program.saved_at[ordinal] : program.used_at[ordinal]] += program.sizes[ordinal]
    assert memory.max() + spec.workspace_bytes == plain.peak_bytes


def test_the_runtime_follows_its_plan_bitwise(tmp_path):
    torch.manual_seed(0)
    layers = []
    for c in (3, 16, 16, 16, 16):
        layers += [torch.nn.Conv2d(c, 16, 3, padding=1), torch.nn.ReLU()]
    model, x = torch.nn.Sequential(*layers), torch.randn(2, 3, 64, 64)
    reference = run_step(model, (x,))
    trace = trace_step(model, [x], _step, device="cpu")
    spec = lms.analysis.device_spec("cpu")
    plain = simulate(trace, None, spec).peak_bytes
    with pytest.raises(lms.PlanInfeasibleError) as floor:
        plan_milp(trace, spec, 1)
    budget = (floor.value.min_budget_bytes + plain) // 2
    plan = plan_milp(trace, spec, budget)
    assert plan.source == "milp" and (plan.offload or plan.recompute)
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=str(tmp_path))
    for _ in range(2):
        assert_bitwise(reference, run_step(model, (x,), offload))
    offload.close()


def test_without_scipy_it_names_the_extra(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else found(name, *a)
    )
    with pytest.raises(MissingExtraError, match=r"large-model-support\[solver\]"):
        plan_milp(trace_of(Chain), small_spec(), 1)


def _step(model, batch):
    loss = model(*batch).square().mean()
    loss.backward()
    return loss
