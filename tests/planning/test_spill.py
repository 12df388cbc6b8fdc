"""Host memory short: offloaded data planned into spill files, priced, checked before training."""

import dataclasses

import pytest
import torch

import lms
from lms.analysis import simulate, trace_step
from lms.core.errors import HostMemoryError, SpillError
from lms.core.plan import Plan
from lms.orchestration.tuning import check_offload_room
from lms.planning import plan_greedy
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan
from lms.planning.spans import place_spill
from tests.conftest import assert_bitwise, run_step
from tests.planning.test_planners import Chain, small_spec, trace_of


def test_place_spill_holds_host_memory_to_its_limit_and_spills_the_first_saved():
    spans = [(0, 9, 10), (1, 8, 10), (2, 7, 10), (3, 6, 10)]  # all four held over ops 3..6
    assert place_spill(spans, range(4), 40, 10) == ()
    assert place_spill(spans, range(4), 25, 10) == (0, 1)
    assert place_spill(spans, [1, 3], 15, 10) == (1,)
    assert place_spill(spans, range(4), 0, 10) == (0, 1, 2, 3)


def _short_of_host():
    trace = trace_of(Chain)
    # matrix products slow beside the link: the plans offload rather than recompute
    spec = dataclasses.replace(small_spec(), peak_flops=1e8)
    plain = simulate(trace, None, spec)
    _, floor = smallest_plan(Candidates(trace, spec, plain.peak_bytes))
    roomy = plan_greedy(trace, spec, floor.peak_bytes)
    held = simulate(trace, roomy, spec)
    assert held.host_peak_bytes > 0 and not roomy.spill
    short = spec.with_host_memory(held.host_peak_bytes // 2)
    return trace, short, floor.peak_bytes, held


def test_planner_spills_what_host_memory_cannot_hold():
    trace, short, budget, held = _short_of_host()
    plan = plan_greedy(trace, short, budget)
    result = simulate(trace, plan, short)
    assert plan.spill and set(plan.spill) <= set(plan.offload)
    assert result.peak_bytes <= budget
    assert result.host_peak_bytes <= short.host_memory_bytes < held.host_peak_bytes
    assert result.disk_peak_bytes > 0
    # Spilled copies go through a blocking host copy each way: never faster than host memory.
    assert result.step_s >= held.step_s
    assert "spill files" in " ".join(
        lms.analyze(
            Chain, lambda: [torch.randn(2048, 256)], device_spec=short, gpu_memory=budget
        ).lines()
    )


def test_plan_spill_round_trips_and_must_be_offloaded(tmp_path):
    plan = Plan(fingerprint="x", offload=(0, 1, 2), spill=(0,), num_entries=4)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    with pytest.raises(ValueError, match="spill"):
        Plan(fingerprint="x", offload=(1,), spill=(0,), num_entries=4)
    with pytest.raises(ValueError, match="tier='host'"):
        lms.LMS(plan=plan, tier="host")


def test_no_room_for_offloaded_data_is_refused_before_training(tmp_path, monkeypatch):
    trace, short, budget, held = _short_of_host()
    plan = plan_greedy(trace, dataclasses.replace(short, host_memory_bytes=None), budget)
    with pytest.raises(HostMemoryError, match="host budget"):
        check_offload_room(trace, plan, short, host_budget_bytes=held.host_peak_bytes - 1)
    spilling = plan_greedy(trace, short, budget)
    check_offload_room(trace, spilling, short, spill_dir=str(tmp_path))  # room enough

    class Usage:
        free = 1024

    monkeypatch.setattr("shutil.disk_usage", lambda folder: Usage)
    with pytest.raises(SpillError, match="spill files"):
        check_offload_room(trace, spilling, short, spill_dir=str(tmp_path))


def test_runtime_follows_a_plan_with_spills_bitwise(spill_dir):
    torch.manual_seed(0)
    trace = trace_step(Chain, [torch.randn(2048, 256)], device="cpu")
    entries = trace.entries()
    plan = Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(range(len(entries))),
        spill=tuple(range(len(entries) // 2)),
        num_entries=len(entries),
    )
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(2048, 256)
    ref = run_step(model, (x,))
    offload = lms.LMS(plan=plan, spill_dir=spill_dir)
    assert_bitwise(ref, run_step(model, (x,), offload))
    assert offload.stats.spilled_bytes == sum(size for _, size, _ in entries)
    offload.close()
