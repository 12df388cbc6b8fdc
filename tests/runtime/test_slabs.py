"""Plans that run submodules in slabs (Note [Slabs], Note [Which submodules run in slabs]):
chosen only where no plan of the whole step fits, followed exactly by the runtime, and within
the budget on the disk tier."""

import copy
import dataclasses
import logging
import textwrap

import pytest
import torch

import lms
from lms.core.slabs import split_modules
from tests.conftest import assert_bitwise, script_json, spill_files
from tests.runtime.test_memory import COMMON

# MONAI's 3D U-Net on the disk tier, at a budget below what any plan of the whole step needs,
# with what the code holds emptied (free_held) and without.
UNET = COMMON + textwrap.dedent(
    """
    import copy, functools
    from monai.networks.nets import BasicUNet
    from lms.core.slabs import split_modules
    from lms.orchestration.split import _floor_error, fit_in_slabs
    from lms.planning import plan_auto

    fmt = torch.channels_last_3d
    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2,
                      features=(8, 8, 16, 32, 64, 8)).to(memory_format=fmt)
    x = torch.randn(1, 1, 80, 80, 80).contiguous(memory_format=fmt)
    folder = sys.argv[1]
    spec = local_device_spec(torch.device("cpu"))
    traced = functools.partial(trace_step, model, [x], step, device="cpu")
    whole = traced()
    before = whole.param_bytes + whole.buffer_bytes + whole.input_bytes
    budget = before + 110 * 2**20
    floor = _floor_error(whole, spec, budget, half=False, free_held=True).min_budget_bytes
    # the slabs and the plan as tune makes them, less the timing of ops and the climb for speed
    trace = fit_in_slabs(traced, spec, budget, free_held=True, trace=whole, refuse=True)
    slabs = dict(trace.slabs)
    plan = plan_auto(trace, spec, budget, free_held=True, max_simulations=200)
    # sync_mode 3: the runtime's own pace, not the disk's
    plan = dataclasses.replace(plan, slabs=trace.slabs, use_order=trace.use_order, sync_mode=3)
    reference = copy.deepcopy(model)
    with split_modules(reference, slabs):
        step(reference, [x])
    offload = lms.LMS(plan=plan, model=model, budget=budget, tier="disk", spill_dir=folder,
                      free_held=True)
    sim = simulate(trace, plan, spec)
    measured = measured_growth(model, x, offload, steps=2)
    bitwise = all(
        torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), model.parameters()))
    whole_again = "forward" not in model.get_submodule(next(iter(slabs))).__dict__
    print(json.dumps({"floor": floor, "budget": budget, "before": before, "slabs": slabs,
                      "measured": measured, "simulated": sim.peak_tensor_bytes - before,
                      "bitwise": bitwise, "whole_again": whole_again,
                      "offloaded": offload.stats.offloaded_bytes}))
    """
)


@pytest.mark.serial
def test_a_3d_unet_whose_whole_step_fits_no_plan_trains_in_slabs_under_its_budget(spill_dir):
    """No plan of the whole step fits; the planned step runs the decoder's last block in
    slabs, its steps are bitwise those of the same slabs without LMS, and the C heap grows as
    simulated (within 3%) and within the budget."""
    found = script_json(UNET, spill_dir)
    assert found["floor"] > found["budget"], found
    assert found["slabs"] and all(count >= 2 for count in found["slabs"].values()), found
    assert found["bitwise"] and found["whole_again"] and found["offloaded"] > 0, found
    for growth in found["measured"]:
        assert abs(growth - found["simulated"]) <= 0.03 * found["simulated"], found
        assert found["before"] + growth <= found["budget"], found
    assert [f for f in spill_files(spill_dir) if "/plans" not in f] == []


def test_pieces_a_norm_in_slabs_saves_again_are_not_emptied_before_those_saves(spill_dir):
    """Note [A save in forward reads what it saves]: in slabs, a norm saves each piece it
    normalized as its autograd function returns, after the op that read it last; a plan that
    empties what the code holds emptied the pieces from there, and the norm saved them empty.
    The plan now empties each after its last save, and the step runs bitwise."""
    from monai.networks.nets import BasicUNet

    from lms.analysis import trace_step
    from lms.orchestration.local import local_device_spec
    from lms.planning import plan_auto

    fmt = torch.channels_last_3d
    torch.manual_seed(0)
    features = (8, 8, 16, 32, 64, 8)
    model = BasicUNet(3, 1, 2, features=features).to(memory_format=fmt)
    x = torch.randn(1, 1, 80, 80, 80).contiguous(memory_format=fmt)
    slabs = {"upcat_1.convs.conv_0": 4}
    spec = local_device_spec(torch.device("cpu"))
    trace = trace_step(model, [x], _unet_step, device="cpu", slabs=slabs)
    budget = trace.param_bytes + trace.buffer_bytes + trace.input_bytes + 110 * 2**20
    plan = plan_auto(trace, spec, budget, free_held=True, max_simulations=200)
    plan = dataclasses.replace(plan, slabs=trace.slabs, use_order=trace.use_order, sync_mode=3)
    assert plan.free_held
    reference = copy.deepcopy(model)
    with split_modules(reference, slabs):
        _unet_step(reference, [x])
    offload = lms.LMS(
        plan=plan, model=model, budget=budget, tier="disk", spill_dir=spill_dir, free_held=True
    )
    with offload:
        _unet_step(model, [x])
    assert offload.stats.diverged_steps == 0 and offload.stats.emptied_bytes > 0
    pairs = zip(reference.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)


def test_a_step_that_fits_whole_is_never_split():
    model = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU())
    x = torch.randn(1, 1, 16, 16, 16)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    plan = lms.LMS(budget="64MiB").tune(model, [x], step)
    assert plan.slabs == ()


def test_a_plan_with_slabs_needs_the_model_that_has_them():
    plan = lms.Plan(fingerprint="x", offload=(), num_entries=0, slabs=(("block", 4),))
    model = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1))
    offload = lms.LMS(plan=plan, model=model, budget="1GiB")
    with pytest.raises(lms.LMSError, match="runs block in slabs"), offload:
        pass
    assert not offload._active


def test_the_runtime_runs_the_plans_slabs_and_gives_the_module_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.InstanceNorm3d(4)),
    )
    x = torch.randn(1, 1, 12, 6, 6)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    plan = lms.Plan(fingerprint="x", offload=(), num_entries=0, slabs=(("1", 3),))
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append("forward" in m.__dict__))
    with lms.LMS(plan=plan, model=model, budget="1GiB"):
        step(model, [x])
    assert seen == [True] and "forward" not in model[1].__dict__


def test_a_step_of_a_copy_of_the_model_with_slabs_is_told_to_step_that_model(caplog):
    """A plan's slabs are installed in the model it was tuned with: a step of a copy saves what
    the whole module does, leaves the plan, and the warning says which model to step."""
    model = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.InstanceNorm3d(4)),
    )
    copied = copy.deepcopy(model)
    plan = lms.Plan(fingerprint="x", offload=(), num_entries=1, slabs=(("1", 3),))
    offload = lms.LMS(plan=plan, model=model, budget="1GiB")
    with caplog.at_level("WARNING", logger="lms"), offload:
        copied(torch.randn(1, 1, 12, 6, 6)).square().mean().backward()
    assert offload.stats.diverged_steps == 1
    assert "runs 1 in slabs in the model it was tuned with" in caplog.text
    assert "step that model, not a copy" in caplog.text


def _small_unet():
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 8, 4))


def _unet_step(model, batch):
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


def test_analyze_plans_in_slabs_only_where_allowed_and_needed():
    """At a budget below the whole step's floor, `analyze` plans the step in slabs and says
    so; with ``slabs=False`` it finds no plan; at a budget the whole step fits, no slabs."""
    from lms.orchestration.split import _floor_error

    model, x = _small_unet(), torch.randn(1, 1, 64, 64, 64)
    spec = lms.device_spec("cpu")  # no workspace margin: the tensors set the floor
    whole = lms.analyze(model, [x], _unet_step, gpu_memory="64GiB", device_spec=spec)
    floor = _floor_error(whole.trace, spec, 1, half=False, free_held=False).min_budget_bytes
    budget = int(floor * 0.9)
    split = lms.analyze(model, [x], _unet_step, gpu_memory=budget, device_spec=spec)
    assert split.fits and split.plan is not None and split.plan.slabs == split.trace.slabs
    assert split.trace.slabs and any("In slabs" in line for line in split.lines())
    assert split.planned is not None and split.planned.peak_bytes <= budget
    refused = lms.analyze(model, [x], _unet_step, gpu_memory=budget, device_spec=spec, slabs=False)
    assert not refused.fits and refused.trace.slabs == ()
    roomy = lms.analyze(model, [x], _unet_step, gpu_memory=int(floor * 1.2), device_spec=spec)
    assert roomy.trace.slabs == ()


def test_slabs_are_not_traced_where_they_cannot_lower_the_floor():
    """Slabs lower neither the spec's workspace, nor the weights, batch and gradients the step
    holds at its end: a budget under those is refused without tracing a slab (each trace in
    slabs of a long feature extractor takes half a minute)."""
    from lms.analysis import simulate, trace_step
    from lms.orchestration.split import _floor_error, fit_in_slabs

    wide = [torch.nn.Conv2d(256, 256, 3, padding=1) for _ in range(3)]  # weights over activations
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 256, 3, padding=1), *wide)
    x = torch.randn(1, 3, 24, 24)
    whole = trace_step(model, [x], _unet_step, device="cpu")
    spec = dataclasses.replace(lms.device_spec("cpu"), workspace_bytes=64 * 2**20)
    held = whole.param_bytes + whole.buffer_bytes + whole.input_bytes + whole.gradient_bytes
    traced = []

    def trace_with(slabs, max_ops=None):
        traced.append(slabs)
        return trace_step(model, [x], _unet_step, device="cpu", slabs=slabs)

    floor = _floor_error(whole, spec, 1, half=False, free_held=False).min_budget_bytes
    under = spec.workspace_bytes + held - 1
    ours = spec.workspace_bytes
    assert under - ours > 0.5 * (floor - ours)  # the share of the floor searched: not what refuses
    assert fit_in_slabs(trace_with, spec, under, trace=whole) is whole and traced == []
    tensors = simulate(whole, None, spec).peak_bytes - spec.workspace_bytes
    assert held < tensors  # the activations are what slabs could lower


class _DenseBlock(torch.nn.Module):
    """Each layer normalizes everything before it and adds its own features (DenseNet's)."""

    def __init__(self, layers=6, grow=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.BatchNorm2d(4 + i * grow),
                torch.nn.ReLU(),
                torch.nn.Conv2d(4 + i * grow, grow, 3, padding=1),
            )
            for i in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return x


def test_a_trace_in_slabs_that_multiplies_the_steps_ops_is_stopped(caplog, monkeypatch):
    """Note [Which submodules run in slabs]: a dense block read a slab at a time runs its
    concatenated features again for every piece; the trace stops at twice as many ops as the
    slabs times the whole step's (here with no least count of ops, which a step this small
    would stay under), its layers are tried in its place, and where none fits the step is
    planned whole."""
    from lms.analysis import trace_step
    from lms.core.slabs import SplitError
    from lms.orchestration import split
    from lms.orchestration.split import _floor_error, fit_in_slabs

    monkeypatch.setattr(split, "LEAST_OPS_STOPPED", 0)

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), _DenseBlock(), torch.nn.Conv2d(28, 2, 1)
    )
    x = torch.randn(2, 1, 32, 32)
    whole = trace_step(model, [x], _unet_step, device="cpu")
    in_slabs = trace_step(model, [x], _unet_step, device="cpu", slabs={"1": 4})
    assert len(in_slabs.ops) > 2 * 4 * len(whole.ops)  # what the limit is for
    with pytest.raises(SplitError, match=f"ran past {8 * len(whole.ops)} ops"):
        trace_step(model, [x], _unet_step, device="cpu", slabs={"1": 4}, max_ops=8 * len(whole.ops))
    spec = lms.device_spec("cpu")
    floor = _floor_error(whole, spec, 1, half=False, free_held=False).min_budget_bytes
    traced = []

    def trace_with(slabs, max_ops=None):
        traced.append((slabs, max_ops))
        return trace_step(model, [x], _unet_step, device="cpu", slabs=slabs, max_ops=max_ops)

    with caplog.at_level(logging.INFO, logger="lms"):
        assert fit_in_slabs(trace_with, spec, floor - 1, trace=whole) is whole
    stopped = traced.index(({"2": 4, "1": 4}, 8 * len(whole.ops)))  # the dense block's slabs
    later = [name for slabs, _ in traced[stopped + 1 :] for name in slabs]
    assert "1" not in later and any(name.startswith("1.layers.") for name in later)  # its layers
    assert any(
        "in slabs the step stopped" in r.getMessage()
        and "ran past" in r.getMessage()
        and "the submodules of 1 are tried" in r.getMessage()
        for r in caplog.records
    )


def test_a_small_step_mostly_in_slabs_is_traced_in_them_past_twice_its_ops_per_slab():
    """Note [Which submodules run in slabs]: a small SegResNet's levels, group norms and
    residual sums in slabs, run far more ops per op than twice their slabs (each norm's
    statistics, each convolution's halo), yet trace in a second or two: under
    `LEAST_OPS_STOPPED` the search goes on until a trace in slabs fits the budget."""
    from monai.networks.nets import SegResNet

    from lms.analysis import trace_step
    from lms.orchestration.split import LEAST_OPS_STOPPED, _floor_error, fit_in_slabs

    torch.manual_seed(0)
    model = SegResNet(
        spatial_dims=3, in_channels=1, out_channels=2, blocks_down=(1, 1), blocks_up=(1,)
    )
    x = torch.randn(1, 1, 48, 48, 48)
    whole = trace_step(model, [x], _unet_step, device="cpu")
    spec = lms.device_spec("cpu")
    budget = int(0.9 * _floor_error(whole, spec, 1, half=False, free_held=False).min_budget_bytes)

    def trace_with(slabs, max_ops=None):
        return trace_step(model, [x], _unet_step, device="cpu", slabs=slabs, max_ops=max_ops)

    split = fit_in_slabs(trace_with, spec, budget, trace=whole, refuse=True)
    most = 2 * max(count for _, count in split.slabs) * len(whole.ops)
    assert split.slabs and most < len(split.ops) <= LEAST_OPS_STOPPED
    assert _floor_error(split, spec, budget, half=False, free_held=False) is None


def test_a_module_whose_slabs_stop_the_trace_gives_way_to_the_block_inside_it(monkeypatch):
    """Note [Which submodules run in slabs]: MONAI's UNet holds its whole network in ``model``;
    where that module's slabs stop the trace (here past twice the slabs times the whole step's
    ops, with no least count), the block inside it where the step peaks runs in slabs instead,
    and fits."""
    from monai.networks.nets import UNet

    from lms.analysis import trace_step
    from lms.orchestration import split
    from lms.orchestration.split import _floor_error, fit_in_slabs

    monkeypatch.setattr(split, "LEAST_OPS_STOPPED", 0)
    torch.manual_seed(0)
    model = UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)
    x = torch.randn(1, 1, 48, 48, 48)
    whole = trace_step(model, [x], _unet_step, device="cpu")
    spec = lms.device_spec("cpu")
    budget = int(0.9 * _floor_error(whole, spec, 1, half=False, free_held=False).min_budget_bytes)
    traced = []

    def trace_with(slabs, max_ops=None):
        traced.append(dict(slabs))
        return trace_step(model, [x], _unet_step, device="cpu", slabs=slabs, max_ops=max_ops)

    split_step = fit_in_slabs(trace_with, spec, budget, trace=whole, refuse=True)
    assert traced[0] == {"model": 4}  # the outermost first: it stopped
    names = [name for name, _ in split_step.slabs]
    assert names and all(name.startswith("model.") for name in names)
    assert _floor_error(split_step, spec, budget, half=False, free_held=False) is None


def test_a_tuned_plan_in_slabs_is_cached_and_loaded_for_its_step(tmp_path, caplog):
    from lms.orchestration.split import _floor_error

    model, x = _small_unet(), torch.randn(1, 1, 48, 48, 48)
    from lms.analysis import trace_step
    from lms.orchestration.local import local_device_spec

    whole = trace_step(model, [x], _unet_step, device="cpu")
    spec = local_device_spec(torch.device("cpu"))
    floor = _floor_error(whole, spec, 1, half=False, free_held=False).min_budget_bytes
    budget = int(floor * 0.9)
    first = lms.LMS(budget=budget).tune(model, [x], _unet_step, cache_dir=str(tmp_path))
    assert first.slabs
    with caplog.at_level(logging.INFO, logger="lms"):
        again = lms.LMS(budget=budget).tune(model, [x], _unet_step, cache_dir=str(tmp_path))
    assert again == first
    assert any("Loaded the plan" in r.getMessage() for r in caplog.records)
    # a plan in slabs, cached or not, says that the gradients are no longer the plain bits
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not bit for bit" in m and "slabs=False" in m for m in warned), warned
    with pytest.raises(lms.PlanInfeasibleError):
        lms.LMS(budget=budget, slabs=False).tune(model, [x], _unet_step, cache_dir=str(tmp_path))


def test_what_a_module_in_slabs_saves_is_recomputed_as_the_plan_says(spill_dir):
    """Each recomputable storage of the step in slabs remade in backward (the normalized
    pieces among them): every one the plan names is replayed, bitwise."""
    from lms.analysis import trace_step
    from lms.core.recipes import recipes
    from lms.core.slabs import split_modules
    from tests.conftest import assert_bitwise, run_step
    from tests.planning.test_recompute import _plan_recomputing

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.Sequential(
            torch.nn.Conv3d(4, 4, 3, padding=1),
            torch.nn.InstanceNorm3d(4, affine=True),
            torch.nn.LeakyReLU(0.1, inplace=True),
            torch.nn.Conv3d(4, 4, 3, padding=1),
        ),
    )
    x = torch.randn(1, 1, 16, 8, 8)
    slabs = {"1": 4}
    trace = trace_step(model, [x], None, device="cpu", min_offload_bytes=0, slabs=slabs)
    normalized = {
        ordinal
        for ordinal, recipe in recipes(trace).items()
        if trace.ops[recipe.ops[0]].name == "aten._native_batch_norm_legit_no_training.default"
    }
    assert len(normalized) >= 4
    plan = dataclasses.replace(_plan_recomputing(trace, normalized), slabs=tuple(slabs.items()))
    with split_modules(model, slabs):
        reference = run_step(model, [x])
    offload = lms.LMS(plan=plan, model=model, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for step in (1, 2):
        assert_bitwise(reference, run_step(model, [x], offload))
        assert offload.stats.recomputed_tensors == step * len(plan.recompute)
    offload.close()


def test_a_submodule_that_cannot_run_in_slabs_gives_way_to_the_convolution_inside_it(caplog):
    """Its forward reads a tensor that is neither an input, a parameter nor a buffer: the
    recording refuses, with the reason, and the convolution inside it runs in slabs instead
    (Note [Which submodules run in slabs])."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv3d(4, 4, 3, padding=1)
            self.scale = torch.ones(1)  # neither a parameter nor a buffer

        def forward(self, x):
            return self.conv(x) * self.scale

    model = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), Scaled())
    x = torch.randn(1, 1, 32, 32, 32)
    from lms.orchestration.split import _floor_error

    whole = lms.analyze(model, [x], _unet_step, gpu_memory="64GiB", device_spec="cpu")
    floor = _floor_error(whole.trace, whole.spec, 1, half=False, free_held=False)
    assert floor is not None
    with caplog.at_level(logging.INFO, logger="lms"):
        report = lms.analyze(
            model, [x], _unet_step, gpu_memory=floor.min_budget_bytes * 9 // 10, device_spec="cpu"
        )
    assert report.fits and report.trace.slabs == (("1.conv", 4),)
    assert any(
        "With 1 in 4 in slabs the step stopped" in r.getMessage()
        and "neither an input" in r.getMessage()
        and "the submodules of 1 are tried" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("ahead", [False, True])
def test_more_slabs_are_planned_only_where_their_step_without_offload_could_be_faster(ahead):
    """Note [Slabs that make a step faster]: a try whose step without offload is no faster
    than the plan it would replace is not planned; one that could be faster is, and stands
    only where its plan is predicted faster."""
    import functools

    from lms.analysis import simulate, trace_step
    from lms.orchestration.split import faster_in_slabs

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.ReLU()),
    )
    traced = functools.partial(trace_step, model, [torch.randn(1, 1, 32, 16, 16)], _unet_step)
    trace = traced(slabs={"1": 4})
    spec = lms.device_spec("cpu")
    plain = simulate(trace, None, spec)
    # a plan predicted at twice the step (ahead: room for more slabs) or just over 5% above it
    result = dataclasses.replace(plain, step_s=plain.base_step_s * (2 if ahead else 1.06))
    first = lms.Plan(fingerprint="x", offload=(), num_entries=0)
    planned: list[dict[str, int]] = []

    def planner(step):
        planned.append(dict(step.slabs))
        return first

    chosen, _, _ = faster_in_slabs(traced, trace, (first, result), planner, spec)
    steps = [simulate(traced(slabs={"1": n}), None, spec).step_s for n in (4, 8, 16)]
    assert steps[0] * 1.06 * 0.98 < steps[1] < steps[0] * 2 * 0.98 <= steps[2]  # the premise
    # 8 slabs (with the submodule where the plan peaks in 4) stand where the plan took twice
    # the step; 16 are no faster than 8 without offload
    assert [step["1"] for step in planned] == ([8] if ahead else [])
    assert dict(chosen.slabs) == (planned[0] if ahead else {"1": 4})


def test_the_submodule_named_for_slabs_is_one_forward_calls():
    """Note [Which submodules run in slabs]: a ``ModuleList`` on the path to the op at the
    floor is never called, so the block it holds is named instead; a block without a
    convolution is named by none."""
    from lms.analysis import trace_step
    from lms.orchestration.split import _unit

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                [torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3, padding=1)), torch.nn.ReLU()]
            )

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    trace = trace_step(Net(), [torch.randn(1, 1, 8, 8)], lambda m, b: m(*b).sum().backward())
    assert "Net.blocks" not in trace.modules and "Net.blocks.0" in trace.modules
    assert _unit(trace, "Net.blocks.0.0") == "blocks.0"
    assert _unit(trace, "Net.blocks.1") is None


def test_a_module_runs_in_slabs_under_autocast():
    """Note [Slabs recorded under autocast]: the recorded forward meets weights in single
    precision and inputs autocast made half, as each slab does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.ReLU()),
    )
    reference = copy.deepcopy(model)
    x = torch.randn(1, 1, 12, 6, 6)

    def step(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(*batch)
        loss = out.float().square().mean()
        loss.backward()
        return loss

    with split_modules(reference, {"1": 3}):
        expected = step(reference, [x])
    plan = lms.Plan(fingerprint="x", offload=(), num_entries=0, slabs=(("1", 3),))
    with lms.LMS(plan=plan, model=model, budget="1GiB"):
        loss = step(model, [x])
    grads = [[p.grad for p in m.parameters()] for m in (reference, model)]
    assert_bitwise((expected, grads[0]), (loss, grads[1]))
