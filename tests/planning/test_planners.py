"""Planner properties on small real graphs (chains, skips, branches) and a brute-force oracle."""

import contextlib
import importlib.util
import itertools

import pytest
import torch
import torch.nn as nn

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.analysis.simulate import share_of_peak
from lms.core.plan import Plan
from lms.core.units import format_bytes
from lms.planning import plan_auto, plan_greedy, plan_milp, tune_tflms
from lms.planning.candidates import Candidates
from lms.planning.greedy.restarts import kinds as _kinds
from tests.conftest import assert_bitwise, assert_followed


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)]
        )

    def forward(self, x):
        return self.layers(x)


class Skips(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.sigmoid(block(x))
        return x


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(512, 256)

    def forward(self, x):
        left, right = torch.tanh(self.a(x)), torch.sigmoid(self.b(x))
        return torch.tanh(self.c(torch.cat([left, right], dim=1)))


SPEC = device_spec("v100-32gb-pcie3")


def small_spec():
    # a slow link and no workspace margin, so that what moves matters
    import dataclasses

    return dataclasses.replace(SPEC, workspace_bytes=0, d2h_gbps=0.5, h2d_gbps=0.5)


def trace_of(model_cls):
    return trace_step(model_cls, lambda: [torch.randn(2048, 256)], device="cpu")


def _normed_blocks_trace(count):
    """The trace of ``count`` blocks of Linear, BatchNorm and Tanh over a batch of 2048."""

    def model():
        blocks = [(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Tanh()) for _ in range(count)]
        return nn.Sequential(*[m for block in blocks for m in block])

    return trace_step(model, lambda: [torch.randn(2048, 256)], device="cpu")


def oracle(trace, spec, budget):
    """The fastest fitting plan over every subset, prefetch distance and sync mode."""
    n = len(trace.entries())
    assert n <= 12
    best = None
    for size in range(n + 1):
        for subset in itertools.combinations(range(n), size):
            modes = [(a, m) for m in (0, 1) for a in (1, 2, 3, 4, 6, 8)] + [(1, 2), (1, 3)]
            for ahead, sync_mode in modes:
                plan = Plan(
                    fingerprint="o",
                    offload=subset,
                    num_entries=n,
                    swapin_ahead=ahead,
                    sync_mode=sync_mode,
                    budget_bytes=budget,
                )
                result = simulate(trace, plan, spec)
                if result.peak_bytes <= budget and (best is None or result.step_s < best):
                    best = result.step_s
    return best


@pytest.mark.parametrize(
    ("planner", "within"),
    [
        (plan_auto, 1.05),
        pytest.param(
            plan_milp,
            1.10,
            marks=pytest.mark.skipif(
                importlib.util.find_spec("scipy") is None, reason="the solver extra"
            ),
        ),
    ],
    ids=["auto", "milp"],
)
@pytest.mark.parametrize("model_cls", [Chain, Skips, Branches])
@pytest.mark.parametrize("fraction", [0.6, 0.75, 0.9])
def test_planners_come_near_the_oracle(planner, within, model_cls, fraction):
    """The default planner within 5% of the best plan there is, the mixed-integer one within 10%
    (Note [The choice as a mixed-integer program])."""
    trace = trace_of(model_cls)
    spec = small_spec()
    plain = simulate(trace, None, spec)
    budget = int(plain.peak_bytes * fraction)
    best = oracle(trace, spec, budget)
    if best is None:
        with pytest.raises(lms.PlanInfeasibleError):
            planner(trace, spec, budget)
        return
    plan = planner(trace, spec, budget)
    result = simulate(trace, plan, spec)
    assert result.peak_bytes <= budget
    assert plan.predicted_peak_bytes == result.peak_bytes
    assert result.step_s <= best * within, (result.step_s, best)


@pytest.mark.parametrize("planner", [plan_greedy, tune_tflms, plan_auto])
def test_every_plan_fits_and_plans_are_monotone_in_the_budget(planner):
    trace = trace_of(Skips)
    spec = small_spec()
    plain = simulate(trace, None, spec)
    previous = None
    for fraction in (0.55, 0.65, 0.75, 0.85, 1.0):
        budget = int(plain.peak_bytes * fraction)
        try:
            plan = planner(trace, spec, budget)
        except lms.PlanInfeasibleError:
            assert previous is None  # once a budget fits, larger ones fit too
            continue
        result = simulate(trace, plan, spec)
        assert result.peak_bytes <= budget
        assert plan.predicted_peak_bytes == result.peak_bytes
        # More memory never costs more time (TFLMS's binary searches promise no such thing).
        if previous is not None and planner is not tune_tflms:
            assert result.step_s <= previous.step_s * 1.0001
        previous = result
    assert previous is not None and previous.offloaded_bytes == 0


def test_the_checker_simulates_each_plan_once():
    # Note: [Each plan simulated once]
    trace = trace_of(Skips)
    spec = small_spec()
    budget = int(simulate(trace, None, spec).peak_bytes * 0.75)
    checker = Candidates(trace, spec, budget)
    plan = checker.plan(range(2), source="test")
    first = checker.run(plan)
    again = checker.run(checker.plan(range(2), source="test"))  # equal, not the same object
    assert checker.simulations == 1 and again is first
    fresh = simulate(trace, plan, spec)
    assert (first.peak_bytes, first.step_s) == (fresh.peak_bytes, fresh.step_s)
    checker.run(checker.plan(range(3), source="test"))
    assert checker.simulations == 2


def test_restarts_keep_each_kind_of_storage_the_plan_moves():
    # Note: [Restarts from the plan found]
    trace = _normed_blocks_trace(3)
    entries = trace.entries()

    def made_by(i):
        alloc_op = trace.storages[entries[i][0]].alloc_op
        return trace.ops[alloc_op].name if alloc_op >= 0 else "input"

    moved = sorted(range(len(entries)), key=lambda i: -entries[i][1])
    groups = _kinds(trace, moved)
    # each block's linear output (saved by its batch norm) and tanh output, the batch alone
    assert sorted(sorted(made_by(i) for i in group) for group in groups) == [
        ["aten.addmm.default"] * 3,
        ["aten.tanh.default"] * 3,
    ]
    sizes = [sum(entries[i][1] for i in group) for group in groups]
    assert sizes == sorted(sizes, reverse=True)
    tanh = next(group for group in groups if made_by(min(group)) == "aten.tanh.default")
    assert _kinds(trace, sorted(tanh)) == []  # one kind alone is all the plan moves
    assert _kinds(trace, moved[:1]) == []


@pytest.mark.parametrize(("above", "searches"), [(-1.0, "several"), (1e9, "one")])
def test_restarts_run_only_for_a_plan_costlier_than_the_simulator_s_error(
    monkeypatch, above, searches
):
    """`RESTART_ABOVE`: a plan predicted within it of the step without offload stands as the
    first search found it; over it, the search restarts."""
    from lms.planning.greedy import restarts
    from lms.planning.greedy.search import Search

    trace = trace_of(Chain)
    spec = device_spec("cpu")
    budget = int(simulate(trace, None, spec).peak_bytes * 0.9)
    calls = []
    best = Search.best
    monkeypatch.setattr(Search, "best", lambda self: calls.append(1) or best(self))
    monkeypatch.setattr(restarts, "RESTART_ABOVE", above)
    plan = plan_greedy(trace, spec, budget)
    assert simulate(trace, plan, spec).peak_bytes <= budget
    assert (len(calls) > 1) == (searches == "several"), calls


def test_infeasible_budget_names_the_op_and_the_minimum():
    trace = trace_of(Chain)
    spec = small_spec()
    with pytest.raises(lms.PlanInfeasibleError) as info:
        plan_auto(trace, spec, 1024)
    error = info.value
    assert error.min_budget_bytes > 1024
    assert error.op_name.startswith("aten.")
    assert "raise the budget" in str(error)
    assert error.op_name in str(error)
    # the minimum it names is enough
    plan = plan_auto(trace, spec, error.min_budget_bytes)
    assert simulate(trace, plan, spec).peak_bytes <= error.min_budget_bytes


def test_a_budget_under_the_weights_and_their_gradients_says_no_batch_fits():
    """Where the weights, buffers and gradients alone are over the budget, a smaller batch
    cannot help: the error says so, with their size, where it otherwise asks for one; where
    they are most of the floor, it says how much of it they take."""
    wide = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 16 MiB of weights
    trace = trace_step(wide, [torch.randn(8, 1024)], device="cpu")
    spec = device_spec("cpu")
    held = trace.param_bytes + trace.buffer_bytes + trace.gradient_bytes
    with pytest.raises(lms.PlanInfeasibleError) as info:
        plan_auto(trace, spec, held - 2**20)
    assert "whatever the batch" in str(info.value) and "lower the batch" not in str(info.value)
    assert format_bytes(held) in str(info.value)
    floor = info.value.min_budget_bytes
    assert floor > held  # the activations' share of the floor: a smaller batch lowers it
    with pytest.raises(lms.PlanInfeasibleError) as info:
        plan_auto(trace, spec, held + (floor - held) // 2)
    assert "lower the batch size" in str(info.value)
    # most of that floor is the weights': the error says how much
    assert f"gradients take {format_bytes(held)} of it" in str(info.value)


def test_tflms_logs_each_passing_set(caplog):
    caplog.set_level("INFO", logger="lms")
    trace = trace_of(Chain)
    spec = small_spec()
    plain = simulate(trace, None, spec)
    tune_tflms(trace, spec, int(plain.peak_bytes * 0.9))
    found = [r.message for r in caplog.records if "Found a parameter set" in r.message]
    assert found and found[0].startswith("[LMS] [Simulator] Found a parameter set: swapout_")
    assert len(set(found)) == len(found), found  # each set once


def test_plan_json_round_trip(tmp_path):
    trace = trace_of(Chain)
    spec = small_spec()
    plan = plan_auto(trace, spec, int(simulate(trace, None, spec).peak_bytes * 0.9))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    with pytest.raises(ValueError, match="outside"):
        Plan(fingerprint="x", offload=(5,), num_entries=3)


def test_tuned_plan_runs_bitwise_and_within_budget(tmp_path, caplog):
    """Through the runtime with the disk tier: the plan is followed and gradients are exact."""
    torch.manual_seed(0)
    model = Skips()
    x = torch.randn(2048, 256)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    def run(ctx=None):
        model.zero_grad(set_to_none=True)
        if ctx is None:
            loss = step(model, [x])
        else:
            with ctx:
                loss = step(model, [x])
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref = run()
    offload = lms.LMS(budget="18MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    plan = offload.tune(model, [x], step, cache_dir=str(tmp_path / "plans"))
    for _ in range(2):
        got = run(offload)
        assert_bitwise(ref, got)
    assert_followed(plan, offload.stats, steps=2)
    assert offload.stats.spilled_bytes == offload.stats.offloaded_bytes  # the CPU's one tier
    with offload:  # the tuned model's parameters are known: no hook on every module call
        assert not torch.nn.modules.module._global_forward_pre_hooks
    # a second tune of the same step loads the cached plan
    caplog.set_level("INFO", logger="lms")
    again = lms.LMS(budget="18MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    assert again.tune(model, [x], step, cache_dir=str(tmp_path / "plans")) == plan
    assert "Loaded the plan" in caplog.text


def test_divergence_is_reported_once_and_falls_back(tmp_path, caplog):
    caplog.set_level("WARNING", logger="lms")
    torch.manual_seed(0)
    model = Chain()
    plan = Plan(fingerprint="x", offload=(0,), num_entries=2)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=str(tmp_path))
    for _ in range(2):
        with offload:
            model(torch.randn(64, 256)).sum().backward()
    assert caplog.text.count("falling back") == 1


def test_a_block_that_saves_nothing_neither_diverges_nor_silences_a_divergence(tmp_path, caplog):
    """Evaluation under the same ``with`` (no_grad) saves nothing: no warning, no diverged step,
    and a later step that does depart from the plan is still reported."""
    caplog.set_level("WARNING", logger="lms")
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(64, 256)
    offload = lms.LMS(budget="1GiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    offload.tune(model, [x], _square_step)
    with offload, torch.no_grad():
        model(x)
    with offload:
        pass
    assert offload.stats.diverged_steps == 0
    assert "falling back" not in caplog.text
    with offload:
        model(torch.randn(128, 256)).square().mean().backward()  # another batch: other saves
        model(x).square().mean().backward()
    assert offload.stats.diverged_steps == 1
    assert caplog.text.count("falling back") == 1


def test_a_plan_that_moves_nothing_runs_light_after_its_first_step(tmp_path):
    from torch.nn.modules import module

    from tests.conftest import hooks_are_gone, run_step

    torch.manual_seed(0)
    model, x = Chain(), torch.randn(64, 256)
    ref = run_step(model, (x,))
    offload = lms.LMS(budget="1GiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    plan = offload.tune(model, [x], _square_step, cache_dir=str(tmp_path / "plans"))
    assert not plan.offload and not plan.recompute
    hooked = []
    model.layers[0].register_forward_pre_hook(
        lambda *_: hooked.append(bool(module._global_forward_pre_hooks))
    )
    saved, light = [], []
    for _ in range(3):
        assert_bitwise(ref, run_step(model, (x,), offload))
        saved.append(offload.stats.saved_tensors - sum(saved))
        light.append(offload._step.light)
    assert light == [False, True, True]  # the first step in full, then light
    assert hooked == [False, False, False]  # tuned: the model's parameters are known
    assert saved[0] == saved[1] == saved[2] > 0  # light steps still count what they save
    assert offload.stats.offloaded_tensors == 0
    assert offload._live == {} and hooks_are_gone()


def test_a_light_step_that_saves_more_falls_back_under_the_budget(tmp_path, caplog):
    from tests.conftest import run_step, spill_files

    caplog.set_level("WARNING", logger="lms")
    torch.manual_seed(0)
    model, small, large = Chain(), torch.randn(64, 256), torch.randn(2048, 256)
    spill = tmp_path / "spill"
    spill.mkdir()
    offload = lms.LMS(budget="12MiB", min_offload_bytes=0, spill_dir=str(spill))
    plan = offload.tune(model, [small], _square_step, cache_dir=str(tmp_path / "plans"))
    assert not plan.offload
    for _ in range(2):  # the first in full, the second light
        run_step(model, (small,), offload)
    assert "falling back" not in caplog.text and offload.stats.offloaded_tensors == 0
    ref = run_step(model, (large,))
    assert_bitwise(ref, run_step(model, (large,), offload))  # 8 MiB of activations, 2 MiB each
    assert "step 3 saves tensors other than the plan was made for" in caplog.text
    assert offload.stats.offloaded_tensors > 0  # the rest of the step under the budget's policy
    offload.close()
    assert spill_files(str(spill)) == []


def test_a_larger_step_than_the_plans_falls_back_where_it_goes_past(tmp_path, caplog):
    from tests.conftest import run_step

    caplog.set_level("WARNING", logger="lms")
    torch.manual_seed(0)
    model, small, large = Chain(), torch.randn(256, 256), torch.randn(1024, 256)
    offload = lms.LMS(budget="3.2MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    plan = offload.tune(model, [small], _square_step, cache_dir=str(tmp_path / "plans"))
    assert len(plan.offload) + len(plan.recompute) < plan.num_entries
    for _ in range(2):
        run_step(model, (small,), offload)
    assert "falling back" not in caplog.text
    assert_followed(plan, offload.stats, steps=2)
    ref = run_step(model, (large,))
    assert_bitwise(ref, run_step(model, (large,), offload))
    assert "step 3 saves tensors other than the plan was made for" in caplog.text
    # as many storages as the plan's step, four times the bytes: the budget moves more of them
    assert offload.stats.offloaded_tensors - 2 * len(plan.offload) > len(plan.offload)
    offload.close()


def _square_step(model, batch):
    loss = model(*batch).float().square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("frozen", [False, True])
def test_transformer_step_follows_its_plan(tmp_path, caplog, frozen):
    # Attention reads out_proj.weight without calling its module, and saves its transpose (a
    # view of a parameter); the runtime must keep it, as the trace does, or the step diverges.
    from lms.harness.zoo import TinyLM, _lm_step

    caplog.set_level("WARNING", logger="lms")
    torch.manual_seed(0)
    model = TinyLM(vocab=1000, dim=64, layers=2, heads=4)
    if frozen:  # a frozen parameter's view is a leaf without grad: kept because tune saw it
        for block in model.blocks:
            block.self_attn.out_proj.weight.requires_grad_(False)
    tokens, targets = torch.randint(0, 1000, (2, 64)), torch.randint(0, 1000, (2, 64))

    def step(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = _lm_step(model, [tokens, targets])
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref = step(contextlib.nullcontext())
    offload = lms.LMS(budget="3MiB", min_offload_bytes=1024, spill_dir=str(tmp_path))
    plan = offload.tune(model, [tokens, targets], _lm_step, cache_dir=str(tmp_path / "plans"))
    for _ in range(2):
        assert_bitwise(ref, step(offload))
    assert "falling back" not in caplog.text
    assert_followed(plan, offload.stats, steps=2)


def test_a_search_stops_at_a_plan_as_fast_as_the_step_without_offload(monkeypatch):
    """Note [A search stops at the step without offload]: no move can beat such a plan by the
    0.1% a move needs, so the search ends there with the plan it would have ended with."""
    from lms.planning.greedy.search import Search

    trace = trace_of(Chain)
    spec = device_spec("v100")
    budget = share_of_peak(trace, spec, 0.9)
    plans, counts = [], []
    real = Candidates.run

    def counted(self, plan):
        counts[-1] = max(counts[-1], self.simulations + (plan not in self._results))
        return real(self, plan)

    monkeypatch.setattr(Candidates, "run", counted)
    for capped_only in (False, True):
        if capped_only:
            monkeypatch.setattr(
                Search, "spent", lambda self: self.candidates.simulations >= self.max_simulations
            )
        counts.append(0)
        plans.append(plan_greedy(trace, spec, budget))
    assert plans[0].predicted_overhead <= 1e-3
    assert (plans[0].offload, plans[0].recompute) == (plans[1].offload, plans[1].recompute)
    assert counts[0] < counts[1] / 2, counts


@pytest.mark.parametrize("fraction", [0.5, 0.6, 0.75, 0.9])
def test_only_the_fastest_prefixes_are_extended(monkeypatch, fraction):
    """Note [Extend the fastest prefixes only]: each starting set grows `EXTENDED` variants'
    longest kept prefixes one storage at a time, and the plan is as fast as with every variant
    grown, in fewer simulations."""
    from lms.planning.greedy import search

    trace = _normed_blocks_trace(6)
    spec = small_spec()
    budget = int(simulate(trace, None, spec).peak_bytes * fraction)
    grown: list[int] = []
    extend = search.Search._extend
    monkeypatch.setattr(
        search.Search, "_extend", lambda self, *a: grown.append(1) or extend(self, *a)
    )
    runs = []
    for extended in (len(search.VARIANTS), search.EXTENDED):
        monkeypatch.setattr(search, "EXTENDED", extended)
        grown.clear()
        checker = Candidates(trace, spec, budget)
        found = search.Search(checker, half=False, max_simulations=20000).best()
        assert found is not None
        runs.append((found[0], checker.simulations, len(grown)))
    (every_s, every_sims, every_grown), (step_s, sims, count) = runs
    assert count < every_grown and sims < every_sims, runs
    assert step_s <= every_s * 1.001, runs


def test_searches_far_behind_the_fastest_are_not_refined(monkeypatch):
    """Note [Refine the searches near the fastest]: a search predicted slower than `BEHIND`
    times the fastest is not refined, though it is its starting set's fastest."""
    from lms.planning.greedy import search

    trace = _normed_blocks_trace(6)
    spec = small_spec()
    budget = int(simulate(trace, None, spec).peak_bytes * 0.6)
    started: list[float] = []
    refine = search.refine
    monkeypatch.setattr(
        search, "refine", lambda c, r, s, *a: started.append(s) or refine(c, r, s, *a)
    )
    refined = {}
    for behind in (1e9, 1.0):
        monkeypatch.setattr(search, "BEHIND", behind)
        started.clear()
        found = search.Search(Candidates(trace, spec, budget), half=False, max_simulations=20000)
        assert found.best() is not None
        refined[behind] = list(started)
    everything, nearest = refined[1e9], refined[1.0]
    assert len(nearest) < len(everything), refined
    assert all(step_s == min(everything) for step_s in nearest), refined


def test_a_search_shows_its_simulations_against_its_cap(monkeypatch):
    """The per-tensor search's progress bar counts every distinct plan it simulates, out of its
    cap, and is closed when the search ends."""
    import lms.planning.greedy as greedy

    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.count, self.closed = kwargs, 0, False
            bars.append(self)

        def update(self, n):
            self.count += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

    monkeypatch.setattr(greedy, "tqdm", Bar)
    counted = []
    run = Candidates.run
    monkeypatch.setattr(
        Candidates,
        "run",
        lambda self, plan: counted.append(self) or run(self, plan),
    )
    trace = trace_of(Skips)
    spec = small_spec()
    plan_greedy(trace, spec, int(simulate(trace, None, spec).peak_bytes * 0.6), max_simulations=500)
    (bar,) = bars
    checker = counted[-1]
    assert bar.kwargs["total"] == 500 and bar.closed and checker.progress is None
    assert 0 < bar.count <= checker.simulations  # the simulations after the search are not shown
