"""Recomputing saved tensors in backward instead of storing them, alone or in chains."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torchvision

import lms
from lms.analysis import simulate, trace_step
from lms.analysis.simulate import op_seconds
from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.planning import plan_greedy
from lms.planning.candidates import Candidates
from lms.planning.greedy.polish import polish as _polish
from lms.planning.greedy.shared import chains_with as _chains
from lms.planning.minimum import smallest_plan
from lms.runtime.recompute import checksum
from tests.conftest import assert_bitwise, run_step
from tests.planning.test_planners import small_spec


class Mixed(nn.Module):
    """BatchNorm + ReLU in place (recomputable), dropout (random mask: never), a residual add."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        a = torch.relu_(self.bn1(self.conv1(x)))
        b = self.drop(a)
        c = torch.nn.functional.gelu(self.bn2(self.conv2(b)).add_(a))
        return self.head(c.mean((2, 3)))


def _resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _step(model, batch):
    loss = model(*batch).float().square().mean()
    loss.backward()
    return loss


def _trace(build, batch):
    torch.manual_seed(0)
    return trace_step(build, batch, _step, device="cpu", min_offload_bytes=0)


def _plan_recomputing(trace, chosen):
    """Recompute ``chosen``, offload the rest."""
    entries = trace.entries()
    return Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(i for i in range(len(entries)) if i not in chosen),
        recompute=tuple(sorted(chosen)),
        num_entries=len(entries),
        swapin_ahead=2,
    )


def _recompute_all(trace):
    """Every recipe whose inputs are not themselves recomputed; the rest offloaded."""
    found = recipes(trace)
    chosen: set[int] = set()
    for ordinal, recipe in sorted(found.items()):
        if not set(recipe.inputs) & chosen and not any(ordinal in found[c].inputs for c in chosen):
            chosen.add(ordinal)
    return _plan_recomputing(trace, chosen)


def _recompute_chains(trace):
    """Every recipe whose recomputed inputs are all chainable (read no earlier in backward)."""
    found = recipes(trace)
    chosen = set(found)
    changed = True
    while changed:
        changed = False
        for ordinal in sorted(chosen):
            recipe = found[ordinal]
            if any(s in chosen and s not in recipe.chainable for s in recipe.inputs):
                chosen.discard(ordinal)
                changed = True
    return _plan_recomputing(trace, chosen)


def _steps_bitwise(build, batch, plan, spill_dir, *, recomputed):
    """Two steps of ``build()`` under ``plan`` against a plain step: each bitwise, with
    ``recomputed`` replays a step; returns the runtime's stats."""
    model = build()
    ref = run_step(model, batch)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for step in (1, 2):
        assert_bitwise(ref, run_step(model, batch, offload))
        assert offload.stats.recomputed_tensors == step * recomputed
    offload.close()
    return offload.stats


def test_recipes_cover_norms_and_activations_but_not_random_ops():
    trace = _trace(Mixed, [torch.randn(2, 3, 32, 32)])
    found = recipes(trace)
    names = [[trace.ops[i].name for i in recipe.ops] for recipe in found.values()]
    assert ["aten.native_batch_norm.default", "aten.relu_.default"] in names
    assert ["aten.native_batch_norm.default", "aten.add_.Tensor"] in names
    assert ["aten.mul.Tensor"] in names  # dropout: the product with its saved mask
    assert not any("bernoulli" in op for ops in names for op in ops)
    assert ["aten.convolution.default"] in names
    # the second BatchNorm's input (conv2's output) is read after its output in backward
    chained = [i for i, recipe in found.items() if recipe.chainable]
    assert chained
    first_use = trace.first_use_op()
    entries = trace.entries()
    for ordinal in chained:
        for source in found[ordinal].chainable:
            assert first_use[entries[source][0]] >= first_use[entries[ordinal][0]]
    # BatchNorm's saved mean and inverse deviation are its second and third outputs: stored
    entries = trace.entries()
    assert all(trace.ops[r.ops[0]].outputs[0] == entries[i][0] for i, r in found.items())


@pytest.mark.parametrize("chains", [False, True], ids=["single", "chains"])
@pytest.mark.parametrize("build", [Mixed, _resnet], ids=["mixed", "resnet18"])
def test_runtime_recomputes_bitwise(build, chains, spill_dir):
    batch = [torch.randn(2, 3, 64, 64)]
    trace = _trace(build, batch)
    plan = (_recompute_chains if chains else _recompute_all)(trace)
    found = recipes(trace)
    chained = [i for i in plan.recompute if set(found[i].inputs) & set(plan.recompute)]
    assert plan.recompute and bool(chained) == chains  # chains: replays start from replays
    stats = _steps_bitwise(build, batch, plan, spill_dir, recomputed=len(plan.recompute))
    assert stats.offloaded_tensors == 2 * len(plan.offload)


@pytest.mark.parametrize(
    "name", ["efficientnet_b0", "mobilenet_v3_small", "regnet_y_400mf", "swin_t"]
)
def test_recompute_chains_bitwise_across_architectures(name, spill_dir):
    # SiLU, hardswish, squeeze-excitation scales, grouped convolutions, stochastic depth and
    # dropout (never replayed), layer norms, shifted windows.
    def build():
        torch.manual_seed(0)
        return getattr(torchvision.models, name)(num_classes=10)

    batch = [torch.randn(2, 3, 64, 64)]
    trace = _trace(build, batch)
    plan = _recompute_chains(trace)
    assert len(plan.recompute) >= 20
    stats = _steps_bitwise(build, batch, plan, spill_dir, recomputed=len(plan.recompute))
    assert stats.replays_differed == 0


class _Decoder3d(nn.Module):
    """A 3D U-Net's decoder level, as MONAI's SegResNet builds it: group norms, in-place ReLUs,
    a trilinear upsampling summed with the skip."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv3d(2, 8, 3, stride=2, padding=1)
        self.norm1, self.conv1 = nn.GroupNorm(4, 8), nn.Conv3d(8, 8, 3, padding=1)
        self.skip = nn.Conv3d(2, 8, 1)
        self.norm2, self.head = nn.GroupNorm(4, 8), nn.Conv3d(8, 2, 1)

    def forward(self, x):
        y = self.conv1(torch.relu_(self.norm1(self.down(x))))
        y = nn.functional.interpolate(y, scale_factor=2, mode="trilinear") + self.skip(x)
        return self.head(torch.relu_(self.norm2(y)))


def test_group_norms_and_upsampling_recompute_bitwise(spill_dir):
    """A group norm's output and an upsampling's had no recipe: SegResNet at 256^3 under 16 GiB
    on an H100 offloaded 7 GiB of them, predicted +212% over its step without offload."""

    def build():
        torch.manual_seed(0)
        return _Decoder3d()

    batch = [torch.randn(2, 2, 16, 16, 16)]
    trace = _trace(build, batch)
    found = recipes(trace)
    made = {trace.ops[recipe.ops[0]].name for recipe in found.values()}
    made |= {trace.ops[i].name for recipe in found.values() for i in recipe.scratch_ops}
    assert {"aten.native_group_norm.default", "aten.upsample_trilinear3d.default"} <= made
    plan = _recompute_all(trace)
    stats = _steps_bitwise(build, batch, plan, spill_dir, recomputed=len(plan.recompute))
    assert stats.replays_differed == 0


def test_a_shortcut_autograd_did_not_save_is_made_again_in_the_replay(spill_dir):
    # A downsampling block sums its shortcut (the downsample's BatchNorm output, which no
    # backward reads) into its own output in place; the output's recipe makes the shortcut
    # first (Note [Remake what was never saved]).
    batch = [torch.randn(2, 3, 64, 64)]
    trace = _trace(_resnet, batch)
    found = recipes(trace)
    through = sorted(i for i, recipe in found.items() if recipe.scratch)
    blocks = [f"ResNet.layer{k}.0" for k in (2, 3, 4)]
    assert [trace.ops[found[i].ops[0]].module for i in through] == [f"{b}.bn2" for b in blocks]
    for i, block in zip(through, blocks, strict=True):
        made = [(trace.ops[k].name, trace.ops[k].module) for k in found[i].scratch_ops]
        assert made == [("aten.native_batch_norm.default", f"{block}.downsample.1")]
    plan = _plan_recomputing(trace, set(through))
    result = simulate(trace, plan, small_spec())
    scratch = {s for i in through for s in found[i].scratch}
    assert scratch <= {iv.storage for iv in result.intervals if iv.kind == "recomputed"}
    stats = _steps_bitwise(_resnet, batch, plan, spill_dir, recomputed=len(through))
    assert stats.replays_differed == 0


def test_replayed_norms_leave_the_running_statistics_as_forward_left_them(spill_dir):
    # BatchNorm's kernel updates the running mean and variance in place without saying so in
    # its schema; a replay that wrote them again would apply the momentum twice a step.
    batch = [torch.randn(2, 3, 64, 64)]
    trace = _trace(_resnet, batch)
    plan = _recompute_chains(trace)
    found = recipes(trace)
    norms = [i for i in plan.recompute if "batch_norm" in trace.ops[found[i].ops[0]].name]
    assert norms
    plain, offloaded = _resnet(), _resnet()
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for _ in range(2):
        assert_bitwise(run_step(plain, batch), run_step(offloaded, batch, offload))
        for a, b in zip(plain.buffers(), offloaded.buffers(), strict=True):
            assert torch.equal(a, b)
    offload.close()


def test_a_freed_input_does_not_hide_a_recipe_behind_its_address(spill_dir):
    # BatchNorm saves its input only once its kernel has run; offloaded to disk, that input is
    # freed before the ReLU after it allocates (often at the address just freed) and is saved.
    # The ReLU's recipe makes the unsaved BatchNorm output from that input: it must name the
    # input by its entry, and not take the reused address for the ReLU output itself.
    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3)
        )

    def run(model, ctx=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_step(model, batch, ctx)

    batch = [torch.randn(2, 3, 64, 64)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trace = trace_step(build, batch, _step, device="cpu", min_offload_bytes=0)
    found = recipes(trace)
    (relu,) = [
        i
        for i, recipe in found.items()
        if recipe.scratch and trace.ops[recipe.ops[0]].name.startswith("aten.relu")
    ]
    plan = dataclasses.replace(
        _plan_recomputing(trace, {relu}), offload=found[relu].inputs, swapin_ahead=1
    )
    plain, offloaded = build(), build()
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for number in range(1, 7):
        assert_bitwise(run(plain), run(offloaded, offload))
        assert offload.stats.recomputed_tensors == number
    offload.close()


def test_simulator_replays_each_storage_of_a_chain_once():
    trace = _trace(_resnet, [torch.randn(2, 3, 64, 64)])
    plan = _recompute_chains(trace)
    spec = small_spec()
    result = simulate(trace, plan, spec)
    seconds = op_seconds(trace, spec, False)
    found = recipes(trace)
    once = sum(seconds[k] for i in plan.recompute for k in found[i].all_ops)
    assert result.recompute_s == pytest.approx(once)
    # a chain whose input backward reads first is refused
    bad = next(
        (i, s)
        for i, recipe in found.items()
        for s in recipe.inputs
        if s in found and s not in recipe.chainable
    )
    wrong = dataclasses.replace(
        plan,
        offload=tuple(i for i in range(plan.num_entries) if i not in bad),
        recompute=tuple(sorted(bad)),
    )
    with pytest.raises(ValueError, match="reads before it"):
        simulate(trace, wrong, spec)


def test_planner_chains_convolutions_where_compute_is_cheap():
    trace = _trace(_resnet, [torch.randn(2, 3, 512, 512)])
    spec = dataclasses.replace(small_spec(), peak_flops=1e15)  # replays cost next to nothing
    plain = simulate(trace, None, spec)
    _, floor = smallest_plan(Candidates(trace, spec, plain.peak_bytes))
    budget = floor.peak_bytes + (plain.peak_bytes - floor.peak_bytes) // 20
    plan = plan_greedy(trace, spec, budget)
    found = recipes(trace)
    names = {trace.ops[found[i].ops[0]].name for i in plan.recompute}
    assert "aten.convolution.default" in names
    assert any(set(found[i].inputs) & set(plan.recompute) for i in plan.recompute)
    result = simulate(trace, plan, spec)
    assert result.peak_bytes <= budget
    # faster than moving what it recomputes
    moved = dataclasses.replace(
        plan, offload=tuple(sorted(plan.offload + plan.recompute)), recompute=()
    )
    assert result.step_s < simulate(trace, moved, spec).step_s


@pytest.mark.parametrize("min_bytes", [0, 80 * 1024], ids=["all-entries", "small-held"])
def test_recompute_survives_retain_graph_and_autocast(min_bytes, spill_dir):
    # With a size floor, autocast's bf16 copies of the convolutions' weights (72 KiB) are too
    # small to offload: the recipes hold them, so the convolutions' outputs stay recomputable.
    batch = [torch.randn(2, 3, 128, 128)]
    model = _resnet()

    def step(ctx=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_step(model, batch, ctx, retain=True)

    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trace = trace_step(
            _resnet, batch, lambda m, b: _step(m, b), device="cpu", min_offload_bytes=min_bytes
        )
    plan = _recompute_chains(trace)
    found = recipes(trace)
    convolutions = [
        i for i in plan.recompute if trace.ops[found[i].ops[0]].name == "aten.convolution.default"
    ]
    assert len(convolutions) >= 5
    ref = step()
    offload = lms.LMS(plan=plan, min_offload_bytes=min_bytes, spill_dir=spill_dir, tier="disk")
    assert_bitwise(ref, step(offload))
    assert offload.stats.recomputed_tensors == len(plan.recompute)
    offload.close()


def _halfway_plan():
    """A small ResNet's trace, a slow link, a budget halfway between the step's peak and the
    least it can take, and the planner's plan for it."""
    trace = _trace(_resnet, [torch.randn(2, 3, 128, 128)])
    spec = small_spec()
    plain = simulate(trace, None, spec)
    _, floor = smallest_plan(Candidates(trace, spec, plain.peak_bytes))
    budget = (floor.peak_bytes + plain.peak_bytes) // 2
    return trace, spec, budget, plan_greedy(trace, spec, budget)


def test_planner_recomputes_where_moving_costs_more():
    trace, spec, budget, plan = _halfway_plan()
    assert plan.recompute
    result = simulate(trace, plan, spec)
    assert result.peak_bytes <= budget
    without = simulate(
        trace,
        Plan(
            fingerprint=plan.fingerprint,
            offload=tuple(sorted(plan.offload + plan.recompute)),
            num_entries=plan.num_entries,
            swapin_ahead=plan.swapin_ahead,
            sync_mode=plan.sync_mode,
        ),
        spec,
    )
    assert result.step_s < without.step_s
    assert result.recompute_s > 0


def test_the_write_log_is_priced_and_planners_recompute_only_where_it_pays():
    """Note [The write log's own cost]: where each op costs the log more than recomputing saves
    in all, the planner moves those tensors instead."""
    trace, spec, budget, plan = _halfway_plan()
    moved = dataclasses.replace(
        plan, offload=tuple(sorted(plan.offload + plan.recompute)), recompute=()
    )
    free, without = simulate(trace, plan, spec), simulate(trace, moved, spec)
    saved = without.step_s - free.step_s
    assert plan.recompute and saved > 0
    costly = dataclasses.replace(spec, write_log_op_s=2 * saved / len(trace.ops))
    priced = simulate(trace, plan, costly)
    assert priced.base_step_s == free.base_step_s  # no offload, no log
    assert priced.step_s > without.step_s == simulate(trace, moved, costly).step_s
    chosen = plan_greedy(trace, costly, budget)
    assert not chosen.recompute
    result = simulate(trace, chosen, costly)
    assert result.peak_bytes <= budget and result.step_s < priced.step_s


def test_a_replay_with_other_bits_is_warned_and_moved_from_then_on(spill_dir, caplog, monkeypatch):
    import lms.runtime.recompute as runtime

    batch = [torch.randn(2, 3, 64, 64)]
    trace = _trace(Mixed, batch)
    plan = _recompute_all(trace)
    model = Mixed()
    ref = run_step(model, batch)
    replay = runtime.replay
    changed = []

    def one_bit_off(recipe, device, fetch):  # as a kernel that picked another algorithm might
        out = replay(recipe, device, fetch)
        if not changed:
            changed.append(True)
            data = torch.empty(0, dtype=torch.uint8).set_(out)
            data[0] ^= 1
        return out

    monkeypatch.setattr(runtime, "replay", one_bit_off)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    with caplog.at_level("WARNING", logger="lms"):
        run_step(model, batch, offload)
    assert offload.stats.replays_differed == 1
    assert "gave other bits than forward made" in caplog.text
    first = offload.stats.recomputed_tensors
    caplog.clear()
    with caplog.at_level("INFO", logger="lms"):
        assert_bitwise(ref, run_step(model, batch, offload))  # that storage now moves
    assert "has no recipe" not in caplog.text  # it was warned about as differing
    assert offload.stats.recomputed_tensors - first == len(plan.recompute) - 1
    assert offload.stats.replays_differed == 1  # only a plan's first step is checked
    offload.close()


class GatedInPlace(nn.Module):
    """Gates, split in chunks that are tensors of their own and changed in place, as PyTorch's C++
    GRU cell does: scaling one chunk by the other, autograd first clones it (the gate's gradient
    reads it as it was), and the scaling that saves the clone changes what the clone read."""

    def __init__(self):
        super().__init__()
        self.gates, self.out = nn.Linear(16, 128), nn.Linear(64, 4)

    def forward(self, x):
        reset, new = self.gates(x).unsafe_chunk(2, 1)
        reset = reset.sigmoid_()
        new.mul_(reset)
        return self.out(torch.tanh(new))


def test_no_replay_reads_an_input_changed_since_its_op_read_it(spill_dir):
    """Note [A replay reads what its op read]: the clone has no recipe, and a plan that keeps
    the gates and recomputes all it can trains bit for bit."""
    batch = [torch.randn(32, 16)]
    trace = _trace(GatedInPlace, batch)
    entries = trace.entries()
    clones = [
        i
        for i, (storage, _, _) in enumerate(entries)
        if trace.ops[trace.storages[storage].alloc_op].name == "aten.clone.default"
    ]
    found = recipes(trace)
    assert clones and not set(clones) & set(found) and found
    plan = Plan(
        fingerprint=trace.fingerprint(),
        offload=(),
        recompute=tuple(sorted(found)),
        num_entries=len(entries),
    )
    stats = _steps_bitwise(GatedInPlace, batch, plan, spill_dir, recomputed=len(found))
    assert stats.replays_differed == 0


def test_a_step_whose_storage_the_plan_recomputes_has_other_bytes_diverges(spill_dir, caplog):
    """Note [A step is checked where its plan recomputes]: a step one storage off its plan is
    caught where the plan would replay another recipe, before it does, and trains bit for bit."""
    batch = [torch.randn(2, 3, 64, 64)]
    trace = _trace(Mixed, batch)
    plan = _recompute_all(trace)
    off = plan.recompute[len(plan.recompute) // 2]
    sizes = [size for _, size, _ in trace.entries()]
    sizes[off] += 4  # the traced storage at that ordinal was another one
    shifted = dataclasses.replace(plan, entry_bytes=tuple(sizes))
    model = Mixed()
    ref = run_step(model, batch)
    offload = lms.LMS(plan=shifted, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    with caplog.at_level("WARNING", logger="lms"):
        assert_bitwise(ref, run_step(model, batch, offload))
    assert f"plan was made for (at save {off})" in caplog.text
    assert offload.stats.diverged_steps == 1 and offload.stats.replays_differed == 0
    assert offload.stats.recomputed_tensors == sum(i < off for i in plan.recompute)
    offload.close()


def _single_moves(checker, plan):
    """Plans that differ from ``plan`` in one tensor kept, offloaded or recomputed instead."""
    found = recipes(checker.trace)
    offload, remade = set(plan.offload) | set(plan.recompute), set(plan.recompute)
    for ordinal in sorted(set(range(plan.num_entries)) - checker.pinned):
        others = remade - {ordinal}
        moves = [(offload - {ordinal}, others), (offload | {ordinal}, others)]
        if ordinal in found and _chains(found, others, ordinal, chains=True):
            moves.append((offload | {ordinal}, remade | {ordinal}))
        for moved, recomputed in moves:
            if (moved, recomputed) != (offload, remade):
                yield checker.plan(
                    moved,
                    ahead=plan.swapin_ahead,
                    sync_mode=plan.sync_mode,
                    source="planner",
                    recompute=recomputed,
                )


def test_polishing_leaves_no_single_move_that_is_faster():
    trace = _trace(_resnet, [torch.randn(2, 3, 128, 128)])
    spec = dataclasses.replace(small_spec(), peak_flops=1e14)
    plain = simulate(trace, None, spec)
    _, floor = smallest_plan(Candidates(trace, spec, plain.peak_bytes))
    budget = (floor.peak_bytes + plain.peak_bytes) // 2
    checker = Candidates(trace, spec, budget)
    start, _ = smallest_plan(checker)  # everything offloaded: far from the best plan
    start_s = checker.run(start).step_s
    plan = _polish(checker, start, start_s, lambda: False)
    result = checker.run(plan)
    assert checker.fits(result)
    assert plan.recompute and result.step_s < start_s
    for other in _single_moves(checker, plan):
        moved = checker.run(other)
        assert not checker.fits(moved) or moved.step_s >= result.step_s * 0.999


@pytest.mark.parametrize("nbytes", [0, 5, 8, 4099, 1 << 24])
def test_checksum_sums_the_words_in_place_and_tells_copies_apart(nbytes):
    # Note [Check the first replays]: summing widened words first made a widened copy, twice
    # the storage (19 GiB for ResNet50's stem output at 12650 px), when memory is tightest.
    torch.manual_seed(0)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        total = checksum(data.untyped_storage(), data.device)
    assert max((e.cpu_memory_usage for e in prof.events()), default=0) <= 1024
    words = nbytes // 8
    expected = sum(data[: words * 8].view(torch.int64).tolist()) + sum(data[words * 8 :].tolist())
    assert int(total) == (expected + 2**63) % 2**64 - 2**63  # wrapping, as int64 sums do
    if nbytes:
        changed = data.clone()
        changed[nbytes // 2] ^= 1
        assert not torch.equal(checksum(changed.untyped_storage(), data.device), total)


def test_the_write_log_flattens_a_call_as_pytree_does():
    """Note [The write log's own cost]: the leaves and spec of each call, as `tree_flatten`
    gives them, whatever the call's shape, and a cached spec only for the same shape."""
    from collections import namedtuple

    from torch.utils._pytree import tree_flatten

    from lms.runtime.writelog import _flatten

    x, y = torch.randn(2, 3), torch.randn(3)
    pair = namedtuple("pair", "a b")
    calls = [
        ((x, y), {}),
        ((x, [1, 2], [0, 0], False), {}),
        ((x, [1, 2, 3], [0, 0], False), {}),  # another length: another spec
        (([x, y], 0), {}),
        ((x, (1, 1)), {"dtype": torch.float16, "out": None}),
        ((x, torch.Size([3, 2])), {}),  # pytree flattens a size
        ((x, pair(1, 2)), {}),
        ((x, [[1, 2], [3]]), {}),
        ((x,), {"sizes": [1, 2]}),
        ((x, [None, y]), {}),
    ]
    for args, kwargs in calls * 2:  # the second time from the cache
        leaves, spec = _flatten(args, kwargs)
        expected, expected_spec = tree_flatten((args, kwargs))
        assert len(leaves) == len(expected) and spec == expected_spec, (args, kwargs)
        assert all(a is b or a == b for a, b in zip(leaves, expected, strict=True))


def test_copies_that_take_the_cores_cost_the_step_their_time_and_planners_move_less():
    """Note [Copies on a CPU take its cores]: where the copies' thread takes a core that compute
    needs, each copy compute does not wait for adds its time to the step, and the planner,
    pricing that, recomputes where it moved tensors over a link fast enough to hide them."""
    trace = _trace(_resnet, [torch.randn(2, 3, 128, 128)])
    spec = dataclasses.replace(small_spec(), d2h_gbps=32.0, h2d_gbps=32.0)
    plain = simulate(trace, None, spec)
    _, floor = smallest_plan(Candidates(trace, spec, plain.peak_bytes))
    budget = (floor.peak_bytes + plain.peak_bytes) // 2
    beside = plan_greedy(trace, spec, budget)
    assert beside.offload and not beside.recompute
    shared = dataclasses.replace(spec, copies_take_compute=True)
    apart, taken = simulate(trace, beside, spec), simulate(trace, beside, shared)
    out_and_back = taken.offloaded_bytes * (1 / spec.d2h_gbps + 1 / spec.h2d_gbps) / 1e9
    assert apart.copy_compute_s == 0 and taken.copy_compute_s == pytest.approx(out_and_back)
    assert taken.step_s == pytest.approx(taken.base_step_s + taken.wait_s + out_and_back)
    assert taken.step_s > apart.step_s
    chosen = plan_greedy(trace, shared, budget)
    result = simulate(trace, chosen, shared)
    assert result.peak_bytes <= budget and result.step_s < taken.step_s
    assert result.offloaded_bytes < taken.offloaded_bytes and chosen.recompute


class Fork(nn.Module):
    """A storage three ops save (a ReLU's output, read by two convolutions), whose two
    convolutions' outputs are recomputed from it: as ResNet's input to a downsampling block."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv_a = nn.Conv2d(16, 16, 3, padding=1)
        self.bn_a = nn.BatchNorm2d(16)
        self.conv_b = nn.Conv2d(16, 16, 1)
        self.bn_b = nn.BatchNorm2d(16)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.bn_a(self.conv_a(h)) + self.bn_b(self.conv_b(h))


def test_a_storage_that_replays_read_stays_back_until_its_last_read(spill_dir):
    """An offloaded storage read by three saves and two replays is read back once: the runtime
    let go of it after its second read, as the replays' references went, and read it back for
    the third, where the simulator held it (ResNet50 at 8000 px on an H200: a 2 GB storage read
    back twice, backward waiting 56 ms for the second)."""
    torch.manual_seed(0)
    model, inputs = Fork(), (torch.randn(2, 3, 64, 64),)
    trace = trace_step(model, inputs, _step, device="cpu", min_offload_bytes=0)
    entries, uses = trace.entries(), trace.use_ops()
    h = max(range(len(entries)), key=lambda i: len(uses.get(entries[i][0], ())))
    assert len(uses[entries[h][0]]) == 3
    remade = sorted(i for i, recipe in recipes(trace).items() if recipe.inputs == (h,))
    assert len(remade) == 2, remade
    plan = Plan(
        fingerprint=trace.fingerprint(),
        num_entries=len(entries),
        offload=(h,),
        recompute=tuple(remade),
        swapin_ahead=1,
        sync_mode=0,
    )
    clock = simulate(trace, plan, small_spec()).residency.clock
    assert h in clock.in_issue and h not in clock.reload_start  # one copy in, held to the last read
    ref = run_step(model, inputs)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for _ in range(2):
        before = offload.stats.reloaded_bytes
        assert_bitwise(ref, run_step(model, inputs, offload))
        assert offload.stats.reloaded_bytes - before == entries[h][1]
    offload.close()
