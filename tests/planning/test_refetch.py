"""Reading a tensor back for each use in backward instead of holding it between uses."""

import dataclasses

import pytest
import torch
import torch.nn as nn

import lms
from lms.analysis import simulate, trace_step
from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.planning import plan_auto, plan_greedy
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan
from tests.conftest import assert_bitwise, run_step
from tests.planning.test_planners import small_spec


class Reuse(nn.Module):
    """``h`` is read by the product's backward first and by the chain's first layer much later."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.chain = nn.Sequential(
            nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)
        )

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h * self.chain(h)


def _step(model, batch):
    loss = model(*batch).float().square().mean()
    loss.backward()
    return loss


def _trace():
    torch.manual_seed(0)
    return trace_step(Reuse(), [torch.randn(2048, 256)], _step, device="cpu", min_offload_bytes=0)


def _plans(trace):
    entries = trace.entries()
    uses = trace.use_ops()
    many = tuple(i for i, (s, _, _) in enumerate(entries) if len(uses.get(s, ())) > 1)
    base = dict(
        fingerprint=trace.fingerprint(),
        offload=tuple(range(len(entries))),
        num_entries=len(entries),
        swapin_ahead=1,
        sync_mode=3,
    )
    return Plan(**base), Plan(**base, refetch=many), many


def test_reading_back_per_use_lowers_the_simulated_peak_and_costs_a_copy():
    trace = _trace()
    held, per_use, many = _plans(trace)
    assert many, "h is read at two places in backward"
    spec = small_spec()
    a, b = simulate(trace, held, spec), simulate(trace, per_use, spec)
    assert b.peak_bytes < a.peak_bytes
    assert b.wait_s > a.wait_s  # the second read is a copy backward waits for


def test_planner_reads_back_per_use_only_when_holding_cannot_fit():
    # h is also a gradient junction, and relieving it lowers the peak as much: the planner tries
    # that first, so this test takes the junction out of the trace.
    full = _trace()
    assert full.junctions
    plan = plan_greedy(full, small_spec(), simulate(full, _plans(full)[1], small_spec()).peak_bytes)
    assert plan.relieved_junctions and not plan.refetch
    trace = dataclasses.replace(full, junctions=())
    spec = small_spec()
    held, per_use, _ = _plans(trace)
    low = simulate(trace, per_use, spec).peak_bytes
    assert low < simulate(trace, held, spec).peak_bytes
    plan = plan_greedy(trace, spec, low)
    assert plan.refetch and simulate(trace, plan, spec).peak_bytes <= low
    roomy = plan_greedy(trace, spec, simulate(trace, held, spec).peak_bytes)
    assert not roomy.refetch
    checker = Candidates(trace, spec, low - 1)
    try:
        smallest_plan(checker)
    except lms.core.errors.PlanInfeasibleError as error:
        assert error.min_budget_bytes == low
    else:
        raise AssertionError("a budget below the per-use minimum must be infeasible")


class ReuseThrice(Reuse):
    """``h`` is read in backward at two places and meets three partial gradients: relieving the
    junction moves three copies where reading ``h`` back moves one. ``b`` is wide, so that the
    peak falls inside its backward, where no node holds ``h`` (a read lives while its node
    runs: `Trace.read_ends`)."""

    def __init__(self):
        super().__init__()
        self.b = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 256))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h * self.b(h) + self.chain(h)


def test_auto_planner_searches_from_either_remedy_and_keeps_the_faster():
    torch.manual_seed(0)
    trace = trace_step(
        ReuseThrice(), [torch.randn(2048, 256)], _step, device="cpu", min_offload_bytes=0
    )
    (junction,) = trace.junction_ordinals().values()
    assert junction.partials == 3
    spec = small_spec()
    budget = simulate(trace, _plans(trace)[1], spec).peak_bytes  # reading back per use fits
    relieving = plan_greedy(trace, spec, budget)
    reading = plan_greedy(trace, spec, budget, first="refetch")
    assert relieving.relieved_junctions and not relieving.refetch
    assert reading.refetch and not reading.relieved_junctions
    for plan in (relieving, reading):
        assert simulate(trace, plan, spec).peak_bytes <= budget
    faster = min(relieving.predicted_overhead, reading.predicted_overhead)
    assert plan_auto(trace, spec, budget).predicted_overhead == faster
    with pytest.raises(ValueError, match="first"):
        smallest_plan(Candidates(trace, spec, budget), "both")


def test_runtime_reads_back_per_use_bitwise(spill_dir):
    trace = _trace()
    _, plan, many = _plans(trace)
    torch.manual_seed(0)
    model = Reuse()
    inputs = (torch.randn(2048, 256),)
    ref = run_step(model, inputs)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    entries = trace.entries()
    uses = trace.use_ops()
    expected = sum(size for _, size, _ in entries) + sum(
        entries[i][1] * (len(uses[entries[i][0]]) - 1) for i in many
    )
    for _ in range(2):
        before = offload.stats.reloaded_bytes
        assert_bitwise(ref, run_step(model, inputs, offload))
        assert offload.stats.reloaded_bytes - before == expected
    offload.close()


class ReplayReads(nn.Module):
    """``h`` is read by ``d``'s backward, then by the replay of ``relu(h)`` for ``c``'s backward,
    then by ``tanh``'s."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.d = (nn.Linear(256, 256) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.relu(h)) + self.d(h)


def test_a_replay_reads_back_what_it_needs_and_holds_it_for_the_next_use(spill_dir):
    # Note [A replay reads back what it needs]: a source read back per use whose copy backward's
    # first use let go is read back for the replay and held to its next use. The simulator had
    # it off the device until just before that use: ResNet50 at 11500 px on an H100 then peaked
    # 2.3 GiB above its simulation.
    torch.manual_seed(0)
    model, inputs = ReplayReads(), (torch.randn(2048, 256),)
    trace = trace_step(model, inputs, _step, device="cpu", min_offload_bytes=0)
    entries, uses = trace.entries(), trace.use_ops()
    h = max(range(len(entries)), key=lambda i: len(uses.get(entries[i][0], ())))
    (relu,) = [
        i
        for i, recipe in recipes(trace).items()
        if h in recipe.inputs and trace.ops[recipe.ops[0]].name == "aten.relu.default"
    ]
    plan = Plan(
        fingerprint=trace.fingerprint(),
        num_entries=len(entries),
        offload=(h,),
        refetch=(h,),
        recompute=(relu,),
        swapin_ahead=1,
        sync_mode=0,
    )
    result = simulate(trace, plan, small_spec())
    clock = result.residency.clock
    remade = clock.recompute_start[relu]
    first_use, *later = uses[entries[h][0]]
    assert clock.start[first_use] < remade < clock.start[later[0]]
    held = [iv for iv in result.intervals if iv.storage == entries[h][0] and iv.kind == "reloaded"]
    assert any(iv.start_s <= remade < iv.end_s for iv in held)
    assert len(clock.reload_start[h]) == len(later)  # that read serves the next use

    # The runtime reads it back as often: once for the first use, once for the replay.
    ref = run_step(model, inputs)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for _ in range(2):
        before = offload.stats.reloaded_bytes
        assert_bitwise(ref, run_step(model, inputs, offload))
        assert offload.stats.reloaded_bytes - before == (1 + len(later)) * entries[h][1]
    offload.close()
