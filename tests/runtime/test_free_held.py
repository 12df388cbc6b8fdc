"""Plans that empty what the step's code holds (`free_held`): bitwise steps, tensors the code
holds whole again after every step and every fault, memory as simulated (Note [Emptying what
the code holds])."""

import logging
import textwrap
import weakref

import pytest
import torch

import lms
from lms.analysis import trace_step
from lms.core.units import format_bytes
from lms.orchestration.local import local_device_spec
from lms.planning import plan_auto
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan
from lms.planning.spans import emptiable
from lms.runtime.disk import SpillStore
from tests.conftest import assert_bitwise, hooks_are_gone, run_step, script_json, spill_files
from tests.runtime.test_memory import COMMON

MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.a = nn.Conv2d(c, c, 3, padding=1)
            self.c = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.c(torch.relu(self.a(x))) + x)

    class Net(nn.Module):
        # `x = self.layers(x)` holds the stem's output while the blocks run, as ResNet's forward
        # holds layer1's input; the caller holds the batch.
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(16, 16, 3, padding=1)
            self.layers = nn.Sequential(*[Block(16) for _ in range(3)])
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            x = self.stem(x)
            x = self.layers(x)
            return self.head(x.mean((2, 3)))

    def build(size):
        torch.manual_seed(0)
        fmt = torch.channels_last
        batch = torch.randn(1, 16, size, size).contiguous(memory_format=fmt)
        return Net().to(memory_format=fmt), batch

    def step(model, batch):
        loss = model(batch[0]).square().mean()
        loss.backward()
        return loss
    """
)
_space: dict = {}
exec(MODEL, _space)  # the same model in this process and in the measured one
build, step = _space["build"], _space["step"]


def floors(model, x):
    """The smallest budgets that plans fit without and with ``free_held``."""
    trace = trace_step(model, [x], step, device="cpu")
    spec = local_device_spec(torch.device("cpu"))
    found = []
    for free_held in (False, True):
        with pytest.raises(lms.PlanInfeasibleError) as info:
            smallest_plan(Candidates(trace, spec, 1, free_held=free_held))
        found.append(info.value.min_budget_bytes)
    return trace, found


def test_the_code_holds_the_batch_and_the_stems_output_past_their_last_reads():
    model, x = build(64)
    trace, (plain, held) = floors(model, x)
    storages = [storage for storage, _, _ in trace.entries()]
    found = emptiable(trace)
    assert storages.index(trace.ops[0].inputs[0]) in found  # the batch, read by the stem only
    assert len(found) >= 2
    assert held < plain
    spec = local_device_spec(torch.device("cpu"))
    with pytest.raises(lms.PlanInfeasibleError, match="set free_held") as info:
        smallest_plan(Candidates(trace, spec, held))  # the refusal says free_held would fit
    assert info.value.min_budget_bytes == plain
    assert "with it the step fits this budget" in str(info.value)
    with pytest.raises(lms.PlanInfeasibleError) as info:
        smallest_plan(Candidates(trace, spec, 1))
    assert f"with it the step needs {format_bytes(held)}" in str(info.value)


def test_plans_empty_only_where_that_is_faster_or_the_only_fit(caplog):
    model, x = build(256)
    trace, (plain, held) = floors(model, x)
    spec = local_device_spec(torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="lms.planning"):
        between = plan_auto(trace, spec, (plain + held) // 2, free_held=True)
    assert between.free_held  # only emptying fits, and the log says which search stood
    said = [r.getMessage() for r in caplog.records if "free_held:" in r.getMessage()]
    assert said[-1].endswith(f"empties {len(between.free_held)} held storages stands"), said
    roomy = plan_auto(trace, spec, plain + (plain - held), free_held=True)
    filled = plan_auto(trace, spec, plain + (plain - held))
    assert roomy.free_held == () or roomy.predicted_overhead < filled.predicted_overhead - 1e-3
    assert roomy.predicted_overhead <= filled.predicted_overhead


@pytest.mark.parametrize("after_block", [False, True], ids=["backward-inside", "backward-after"])
def test_steps_are_bitwise_and_what_the_code_holds_is_whole_after_each(spill_dir, after_block):
    model, x = build(256)
    _, (plain, held) = floors(model, x)
    offload = lms.LMS(budget=(plain + held) // 2, tier="disk", spill_dir=spill_dir, free_held=True)
    plan = offload.tune(model, [x], step)
    assert plan.free_held
    reference = model.__class__().to(memory_format=torch.channels_last)
    reference.load_state_dict(model.state_dict())
    before = x.clone()
    for _ in range(2):
        ref = run_step(reference, (x,))
        model.zero_grad(set_to_none=True)
        if after_block:
            with offload:
                loss = model(x).square().mean()
            loss.backward()
            got = (loss.detach(), [p.grad for p in model.parameters()])
        else:
            got = run_step(model, (x,), offload)
        assert_bitwise(ref, got)
        assert torch.equal(x, before) and x.untyped_storage().resizable()
    assert offload.stats.emptied_bytes >= 2 * x.untyped_storage().nbytes()
    assert offload.stats.emptied_bytes <= offload.stats.offloaded_bytes


def test_retain_graph_reads_what_was_emptied_twice(spill_dir):
    model, x = build(256)
    _, (plain, held) = floors(model, x)
    offload = lms.LMS(budget=(plain + held) // 2, tier="disk", spill_dir=spill_dir, free_held=True)
    offload.tune(model, [x], step)
    reference = model.__class__().to(memory_format=torch.channels_last)
    reference.load_state_dict(model.state_dict())
    assert_bitwise(
        run_step(reference, (x,), retain=True), run_step(model, (x,), offload, retain=True)
    )
    assert offload.stats.emptied_bytes > 0


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_a_failed_step_fills_what_it_emptied_and_leaves_nothing(spill_dir, fault):
    model, x = build(256)
    _, (plain, held) = floors(model, x)
    offload = lms.LMS(budget=(plain + held) // 2, tier="disk", spill_dir=spill_dir, free_held=True)
    offload.tune(model, [x], step)
    before = x.clone()

    def fail(module, args, output):
        raise fault("stop")

    handle = model.head.register_forward_hook(fail)  # after the blocks: the batch is emptied
    with pytest.raises(fault), offload:
        model(x).square().mean().backward()
    handle.remove()
    assert offload.stats.emptied_bytes > 0
    assert torch.equal(x, before)
    assert spill_files(spill_dir) == []
    assert hooks_are_gone()
    ref = run_step(model, (x,))  # and the next step trains as before
    assert_bitwise(ref, run_step(model, (x,), offload))


def test_closing_gives_back_what_a_step_without_backward_emptied(spill_dir):
    model, x = build(256)
    _, (plain, held) = floors(model, x)
    offload = lms.LMS(budget=(plain + held) // 2, tier="disk", spill_dir=spill_dir, free_held=True)
    offload.tune(model, [x], step)
    before = x.clone()
    with offload:
        loss = model(x).square().mean()
    assert x.untyped_storage().nbytes() == 0  # emptied; the graph waits for backward
    offload.close()  # no backward after all: the batch comes back from its copy
    assert torch.equal(x, before)
    del loss
    assert spill_files(spill_dir) == []


def test_spill_files_leave_storages_resizable(tmp_path):
    store = SpillStore(str(tmp_path))
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    store.write(0, data).result()
    into = torch.empty_like(data)
    store.read(0, into).result()
    store.close()
    assert torch.equal(into, data)
    assert data.untyped_storage().resizable() and into.untyped_storage().resizable()


def test_the_io_thread_keeps_no_reference_once_a_copy_is_done(tmp_path):
    # Note [The I/O thread lets go of a storage before it says it is done]: what the pool's
    # worker still holds after a future is done is the arguments it was given and the result
    store = SpillStore(str(tmp_path))
    given = []
    submit = store._pool.submit
    store._pool.submit = lambda *args: given.append(args) or submit(*args)  # type: ignore
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    into = torch.empty_like(data)
    alive = [weakref.ref(data), weakref.ref(into)]
    store.write(0, data).result()
    assert store.read(0, into).result() is None  # the caller keeps what it reads into
    store.close()
    assert torch.equal(into, data)
    held = [a for args in given for a in args if isinstance(a, (list, torch.Tensor))]
    assert all(isinstance(a, list) and not a for a in held)  # data travelled in emptied lists
    given.clear()
    del data, into
    assert [ref() for ref in alive] == [None, None]


def test_plans_name_only_offloaded_tensors_to_empty():
    with pytest.raises(ValueError, match="free_held"):
        lms.Plan(fingerprint="f", offload=(0,), num_entries=2, free_held=(1,), free_held_at=(3,))
    with pytest.raises(ValueError, match="free_held"):
        lms.Plan(fingerprint="f", offload=(0,), num_entries=2, free_held=(0,))
    plan = lms.Plan(fingerprint="f", offload=(0,), num_entries=2, free_held=(0,), free_held_at=(3,))
    assert lms.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="free_held"):
        lms.LMS(free_held="yes")


MEASURED = (
    COMMON
    + MODEL
    + textwrap.dedent(
        """
    model, x = build(512)
    budget, folder = int(sys.argv[1]), sys.argv[2]
    infeasible = None
    try:  # without free_held
        lms.LMS(budget=budget, tier="disk", spill_dir=folder, slabs=False).tune(
            model, [x], step, cache_dir=folder + "/plans")
    except lms.PlanInfeasibleError as error:
        infeasible = error.min_budget_bytes
    free_held = True
    tuner = lms.LMS(budget=budget, tier="disk", spill_dir=folder, free_held=free_held)
    plan = tuner.tune(model, [x], step, cache_dir=folder + "/plans")
    # copies awaited both ways, so that when a storage is emptied does not depend on how fast
    # the disk is
    plan = dataclasses.replace(plan, sync_mode=3)
    offload = lms.LMS(plan=plan, budget=budget, tier="disk", spill_dir=folder, free_held=free_held)
    trace = trace_step(model, [x], step, device="cpu")
    sim = simulate(trace, plan, local_device_spec(torch.device("cpu")))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    print(json.dumps({"measured": measured_growth(model, x, offload),
                      "simulated": sim.peak_tensor_bytes - before, "before": before,
                      "emptied": offload.stats.emptied_bytes, "fits": sim.peak_bytes <= budget,
                      "infeasible": infeasible}))
    """
    )
)


@pytest.mark.serial
def test_emptying_lowers_the_measured_heap_as_simulated(spill_dir):
    """A budget below what any plan needs without ``free_held`` (80.1 MiB here) is refused
    without it; with it the C heap grows as simulated (within 2%) and stays within the budget."""
    budget = 64 * 2**20

    found = script_json(MEASURED, budget, spill_dir)
    assert found["infeasible"] is not None and found["infeasible"] > budget
    assert found["emptied"] > 0 and found["fits"]
    for growth in found["measured"][1:]:
        assert abs(growth - found["simulated"]) <= 0.02 * found["simulated"]
        assert found["before"] + growth <= budget


# A stem's 64 channels, read by a squeeze to 4 channels and again by the head, and held in
# between while the squeezed ones grow to 256 channels and are averaged back down: forward's
# largest op runs in the gap between the two reads (Note [Gaps in what the code holds]).
GAPPED_NET = textwrap.dedent(
    """
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 64, 3, padding=1)
            self.squeeze = torch.nn.Conv2d(64, 4, 1)
            self.expand = torch.nn.Conv2d(4, 256, 3, padding=1)
            self.head = torch.nn.Conv2d(65, 4, 3, padding=1)

        def forward(self, x):
            x = self.stem(x)
            wide = self.expand(torch.relu(self.squeeze(x)))
            mean = torch.relu(wide.mean(1, keepdim=True))
            del wide  # held to the cat, it would set a card's floor there, where x is read
            return self.head(torch.cat([x, mean], 1))
    """
)
GAPPED = (
    COMMON
    + GAPPED_NET
    + textwrap.dedent(
        """
    import copy
    from lms.planning.candidates import Candidates
    from lms.planning.minimum import smallest_plan

    model, x = Net(), torch.randn(1, 3, 256, 256)
    reference = copy.deepcopy(model)
    step(reference, [x])
    trace = trace_step(model, [x], step, device="cpu")
    spec = local_device_spec(torch.device("cpu"))
    floors = []
    for gaps in (False, True):
        try:
            smallest_plan(Candidates(trace, spec, 1, free_held=True, gaps=gaps))
        except lms.PlanInfeasibleError as error:
            floors.append(error.min_budget_bytes)
    budget = sum(floors) // 2
    plan = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[1], free_held=True).tune(
        model, [x], step, cache_dir=sys.argv[1] + "/plans")
    # copies awaited both ways (the partial gradients a relieved junction sends out too), so
    # that what is resident does not depend on how fast the disk is
    plan = dataclasses.replace(plan, sync_mode=3)
    offload = lms.LMS(plan=plan, budget=budget, tier="disk", spill_dir=sys.argv[1],
                      free_held=True)
    sim = simulate(trace, plan, spec)
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    measured = measured_growth(model, x, offload)
    bitwise = all(  # the last step's gradients
        torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), model.parameters()))
    print(json.dumps({"floors": floors, "budget": budget, "gaps": plan.held_gaps,
                      "measured": measured, "simulated": sim.peak_tensor_bytes - before,
                      "before": before, "fits": sim.peak_bytes <= budget,
                      "fills": offload.stats.gap_fills, "bitwise": bitwise}))
    """
    )
)


@pytest.mark.serial
def test_a_tensor_held_across_forwards_largest_op_goes_out_between_its_reads(spill_dir):
    """Note [Gaps in what the code holds]: emptying only after forward's last read cannot go
    below the floor of the op that runs between the two reads; with the gap emptied, a budget
    below that floor is planned, followed bitwise (one fill a step), and the heap grows as
    simulated within 2%, within the budget."""
    found = script_json(GAPPED, spill_dir)
    without, with_gaps = found["floors"]
    assert with_gaps < found["budget"] < without, found
    assert len(found["gaps"]) == 1 and found["fits"], found
    assert found["fills"] == len(found["measured"]) and found["bitwise"], found
    for growth in found["measured"]:
        assert abs(growth - found["simulated"]) <= 0.02 * found["simulated"], found
        assert found["before"] + growth <= found["budget"], found


def gap_floors(trace, spec) -> list[int]:
    """The smallest budgets a plan with free_held fits, without gaps and with them."""
    floors = []
    for gaps in (False, True):
        with pytest.raises(lms.PlanInfeasibleError) as refused:
            smallest_plan(Candidates(trace, spec, 1, free_held=True, gaps=gaps))
        floors.append(refused.value.min_budget_bytes)
    return floors


def _square_step(model, batch):
    loss = model(*batch).float().square().mean()
    loss.backward()
    return loss


def test_gaps_are_planned_only_where_nothing_fits_without_and_said(spill_dir):
    """Note [Gaps in what the code holds]: the planner empties over gaps only where no plan fits
    emptying after forward's last read alone; the report says so; the clock counts the storage
    out between the gap's ends; and the step follows it bitwise."""
    from lms.analysis import simulate
    from lms.report.text import info_lines

    namespace: dict = {}
    exec(GAPPED_NET, {"torch": torch}, namespace)
    torch.manual_seed(0)
    model, x = namespace["Net"](), torch.randn(1, 3, 96, 96)
    reference = run_step(model, [x])
    trace = trace_step(model, [x], _square_step, device="cpu")  # as run_step's
    spec = local_device_spec(torch.device("cpu"))
    floors = gap_floors(trace, spec)
    assert floors[1] < floors[0]
    roomy = plan_auto(trace, spec, floors[0] + 2**20, free_held=True)
    assert not roomy.held_gaps  # fits without: no read back in forward
    plan = plan_auto(trace, spec, (floors[0] + floors[1]) // 2, free_held=True)
    assert len(plan.held_gaps) == 1
    planned = simulate(trace, plan, spec)
    ((ordinal, _, _),) = plan.held_gaps
    assert planned.peak_bytes <= plan.budget_bytes
    lines = info_lines(
        trace,
        spec,
        simulate(trace, None, spec),
        plan,
        planned,
        budget_bytes=plan.budget_bytes,
        free_held=True,
    )
    assert any("over 1 gaps between forward's reads" in line for line in lines)
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir, free_held=True)
    offload.record_steps()
    for _ in range(2):
        assert_bitwise(reference, run_step(model, [x], offload))
    assert offload.stats.gap_fills == 2
    # the fill is a copy in forward, in the record and in the simulation alike
    backward = planned.backward_start_s
    simulated = [c for c in _clock(trace, plan, spec).copy_spans() if c[:2] == ("in", ordinal)]
    assert any(end <= backward for _, _, _, end in simulated), simulated
    last = offload._log.steps[-1]  # the plan was not tuned here: no record file to save
    first_backward = min(op.start_s for op in last.ops if op.backward)
    fills = [c for c in last.copies if c.direction == "in" and c.ordinal == ordinal]
    assert any(c.end_s <= first_backward and c.tier == "disk" for c in fills), fills
    offload.close()
    assert spill_files(spill_dir) == []


def _clock(trace, plan, spec):
    """The plan's clock on ``spec``, its copies kept (`Clock.copy_spans`)."""
    from lms.analysis.clock import Clock
    from lms.analysis.simulate import op_seconds

    return Clock(trace, plan, spec, op_seconds(trace, spec, False, write_log=bool(plan.recompute)))


# MONAI's 3D U-Net in the channels-last layout on the disk tier, at a budget below what any plan
# needs while its code holds the encoder outputs until its decoder reads them.
UNET = COMMON + textwrap.dedent(
    """
    import copy
    from monai.networks.nets import BasicUNet

    fmt = torch.channels_last_3d
    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2,
                      features=(8, 8, 16, 32, 64, 8)).to(memory_format=fmt)
    x = torch.randn(1, 1, 80, 80, 80).contiguous(memory_format=fmt)
    reference = copy.deepcopy(model)
    step(reference, [x])
    folder = sys.argv[1]
    trace = trace_step(model, [x], step, device="cpu")
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    budget = before + 129 * 2**20
    refused = None
    try:
        lms.LMS(budget=budget, tier="disk", spill_dir=folder, slabs=False).tune(
            model, [x], step, cache_dir=folder + "/plans")
    except lms.PlanInfeasibleError as error:
        refused = error.min_budget_bytes
    plan = lms.LMS(budget=budget, tier="disk", spill_dir=folder, free_held=True).tune(
        model, [x], step, cache_dir=folder + "/plans")
    plan = dataclasses.replace(plan, sync_mode=3)  # as above: not the disk's pace
    offload = lms.LMS(plan=plan, budget=budget, tier="disk", spill_dir=folder, free_held=True)
    sim = simulate(trace, plan, local_device_spec(torch.device("cpu")))
    measured = measured_growth(model, x, offload, steps=2)
    bitwise = all(
        torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), model.parameters()))
    print(json.dumps({"refused": refused, "budget": budget, "before": before,
                      "measured": measured, "simulated": sim.peak_tensor_bytes - before,
                      "emptied": offload.stats.emptied_bytes, "bitwise": bitwise}))
    """
)


@pytest.mark.serial
def test_a_3d_unet_trains_on_disk_under_a_budget_its_held_encoder_outputs_would_break(spill_dir):
    """Without emptying what the code holds (or slabs), no plan fits this budget; with it the
    U-Net's steps are bitwise, and the C heap grows as simulated (within 2%) and within the
    budget."""
    found = script_json(UNET, spill_dir)
    assert found["refused"] is not None and found["refused"] > found["budget"], found
    assert found["emptied"] > 0 and found["bitwise"], found
    for growth in found["measured"]:
        assert abs(growth - found["simulated"]) <= 0.02 * found["simulated"], found
        assert found["before"] + growth <= found["budget"], found
