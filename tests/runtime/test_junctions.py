"""Gradient junctions: the partial gradients of a tensor with several consumers wait off the
device; traced, simulated, planned, and run bit for bit."""

import dataclasses
import textwrap

import pytest
import torch
import torch.nn as nn

import lms
from lms.analysis import simulate, trace_step
from lms.core.errors import HostMemoryError, PlanInfeasibleError
from lms.core.plan import Plan
from lms.orchestration.local import local_device_spec
from lms.planning import plan_greedy
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan
from tests.conftest import assert_bitwise, run_step, script_json, spill_files

MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.a = nn.Conv2d(c, c, 3, padding=1)
            self.b = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):  # x feeds the convolution and the sum: a junction
            return torch.relu(x + self.b(torch.relu(self.a(x))))

    class Residual(nn.Module):
        def __init__(self, c=16, blocks=4):
            super().__init__()
            self.stem = nn.Conv2d(3, c, 3, padding=1)
            self.blocks = nn.Sequential(*[Block(c) for _ in range(blocks)])

        def forward(self, x):
            return self.blocks(torch.relu(self.stem(x)))

    class Fan(nn.Module):  # inception-like: the stem's output feeds three branches

        def __init__(self, c=16, branches=3):
            super().__init__()
            self.stem = nn.Conv2d(3, c, 3, padding=1)
            self.branches = nn.ModuleList(
                nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 1))
                for _ in range(branches)
            )

        def forward(self, x):
            t = torch.relu(self.stem(x))
            return torch.cat([branch(t) for branch in self.branches], 1)

    def step(model, batch):
        loss = model(*batch).mean()
        loss.backward()
        return loss
    """
)
exec(MODEL)  # the same model here and in the measuring subprocess
Residual = globals()["Residual"]
Fan = globals()["Fan"]
step = globals()["step"]


def _trace(size=256):
    torch.manual_seed(0)
    return trace_step(
        Residual(), [torch.randn(1, 3, size, size)], step, device="cpu", min_offload_bytes=0
    )


def _everything_out(trace, relieved=()):
    n = len(trace.entries())
    meeting = trace.junction_ordinals()
    return Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(range(n)),
        num_entries=n,
        swapin_ahead=1,
        sync_mode=3,
        relieved_junctions=tuple(relieved),
        relieved_partials=tuple(meeting[ordinal].partials for ordinal in relieved),
    )


def test_trace_finds_one_junction_per_block():
    trace = _trace()
    junctions = trace.junction_ordinals()
    assert len(junctions) == 4
    activation = 16 * 256 * 256 * 4
    for junction in junctions.values():
        assert junction.partials == 2
        assert junction.nbytes == activation
        assert junction.arrive_ops[0] < junction.arrive_ops[1] <= junction.join_op
        assert trace.ops[junction.join_op].phase == "backward"
        # autograd summed the partials out of place: a third buffer
        assert junction.merged not in junction.grads


def test_relieving_junctions_lowers_the_simulated_peak_and_costs_copies():
    trace = _trace()
    spec = local_device_spec(torch.device("cpu"))
    plain = simulate(trace, _everything_out(trace), spec)
    relieved = simulate(trace, _everything_out(trace, trace.junction_ordinals()), spec)
    activation = 16 * 256 * 256 * 4
    assert plain.peak_tensor_bytes - relieved.peak_tensor_bytes == activation
    assert relieved.relieved_junctions == 4
    assert relieved.relieved_bytes == 4 * activation
    assert relieved.wait_s > plain.wait_s  # each partial is copied out and back


def test_planner_relieves_junctions_only_when_nothing_else_fits():
    trace = _trace()
    spec = local_device_spec(torch.device("cpu"))
    low = simulate(trace, _everything_out(trace, trace.junction_ordinals()), spec).peak_bytes
    high = simulate(trace, _everything_out(trace), spec).peak_bytes
    plan = plan_greedy(trace, spec, low)
    assert plan.relieved_junctions
    assert simulate(trace, plan, spec).peak_bytes <= low
    assert not plan_greedy(trace, spec, high).relieved_junctions
    with pytest.raises(PlanInfeasibleError) as caught:
        smallest_plan(Candidates(trace, spec, low - 1))
    assert caught.value.min_budget_bytes <= low
    assert Plan.from_json(plan.to_json()) == plan


def _fan_trace(branches=3, size=256):
    torch.manual_seed(0)
    return trace_step(
        Fan(branches=branches),
        [torch.randn(1, 3, size, size)],
        step,
        device="cpu",
        min_offload_bytes=0,
    )


def test_trace_finds_a_junction_where_three_partials_meet():
    trace = _fan_trace()
    (junction,) = trace.junction_ordinals().values()
    activation = 16 * 256 * 256 * 4
    assert junction.partials == 3
    assert junction.sizes == (activation,) * 3
    assert junction.taken == 3  # the last goes too; autograd holds a stand-in
    assert junction.nbytes == 3 * activation
    assert list(junction.arrive_ops) == sorted(junction.arrive_ops)
    # The engine summed the first two, then the third into that: two sums, the last merged.
    assert len(junction.accumulated) == 2 and junction.merged == junction.accumulated[-1]
    spec = local_device_spec(torch.device("cpu"))
    plain = simulate(trace, _everything_out(trace), spec)
    relieved = simulate(trace, _everything_out(trace, trace.junction_ordinals()), spec)
    assert plain.peak_tensor_bytes - relieved.peak_tensor_bytes == activation
    assert relieved.relieved_bytes == 3 * activation
    # A plan counting other than three partials there relieves nothing.
    miscounted = dataclasses.replace(
        _everything_out(trace, trace.junction_ordinals()), relieved_partials=(2,)
    )
    assert simulate(trace, miscounted, spec).relieved_junctions == 0


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("sync_mode", [0, 3])
@pytest.mark.parametrize(
    ("branches", "taken"),
    [(0, 4), (3, 3), (5, 5)],  # Residual: 4 junctions of two, the last stays; Fan: all go
)
def test_runtime_relieves_junctions_bitwise(spill_dir, branches, taken, sync_mode, retain):
    trace = _fan_trace(branches) if branches else _trace()
    plan = _everything_out(trace, trace.junction_ordinals())
    plan = dataclasses.replace(plan, sync_mode=sync_mode)
    torch.manual_seed(0)
    model = Fan(branches=branches) if branches else Residual()
    inputs = (torch.randn(1, 3, 256, 256),)
    mean = lambda out: out.mean()  # noqa: E731
    ref = run_step(model, inputs, loss_fn=mean, retain=retain)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    for number in range(1, 3):
        assert_bitwise(ref, run_step(model, inputs, offload, loss_fn=mean, retain=retain))
        backwards = 2 if retain else 1
        assert offload.stats.relieved_partials == taken * backwards * number
    assert spill_files(spill_dir) == []
    offload.close()


class SignedZeros(nn.Module):
    """``t`` meets three partials that are -0.0 wherever every branch weight is zero; the
    gradient of ``scale`` is that sum times a positive input, so it shows the sign of each zero.
    Adding autograd's stand-in (+0.0) to the sum would turn them to +0.0."""

    def __init__(self, branches=3, size=64):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 4, size, size))
        weights = torch.randn(branches, 1, 4, size, size)
        weights[:, :, :, : size // 2] = 0  # zero in every branch: those sums are -0.0
        self.weights = nn.ParameterList(nn.Parameter(w) for w in weights)

    def forward(self, x):
        t = self.scale * x
        return torch.cat([torch.tanh(t * w) for w in self.weights], 1)  # tanh saves: in sight


def test_the_stand_in_for_the_last_partial_is_never_added(spill_dir):
    x = torch.rand(1, 4, 64, 64) + 1
    negative = lambda out: -out.mean()  # noqa: E731

    def loss_step(model, batch):
        loss = negative(model(*batch))
        loss.backward()
        return loss

    trace = trace_step(SignedZeros, [x], loss_step, min_offload_bytes=0)
    (junction,) = trace.junction_ordinals().values()
    assert junction.partials == junction.taken == 3
    torch.manual_seed(0)
    model = SignedZeros()
    ref = run_step(model, (x,), loss_fn=negative)
    zeros = ref[1][0] == 0
    assert zeros.any() and torch.signbit(ref[1][0][zeros]).all()
    offload = lms.LMS(
        plan=_everything_out(trace, trace.junction_ordinals()),
        min_offload_bytes=0,
        tier="disk",
        spill_dir=spill_dir,
    )
    assert_bitwise(ref, run_step(model, (x,), offload, loss_fn=negative))
    assert offload.stats.relieved_partials == 3
    offload.close()


def test_a_partial_that_cannot_go_out_hands_autograd_the_sum_so_far(spill_dir, monkeypatch):
    trace = _fan_trace(branches=4)
    n = len(trace.entries())
    relieved = tuple(trace.junction_ordinals())
    plan = Plan(
        fingerprint=trace.fingerprint(),
        offload=(),
        num_entries=n,
        relieved_junctions=relieved,
        relieved_partials=(4,),
    )
    torch.manual_seed(0)
    model, inputs = Fan(branches=4), (torch.randn(1, 3, 256, 256),)
    mean = lambda out: out.mean()  # noqa: E731
    ref = run_step(model, inputs, loss_fn=mean)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    calls = []
    real = offload._offloader.offload

    def second_fails(entry, **kwargs):  # only partials go out: the plan offloads nothing
        calls.append(entry.nbytes)
        if len(calls) % 2 == 0:
            raise HostMemoryError("lms: host memory is full (test)")
        return real(entry, **kwargs)

    monkeypatch.setattr(offload._offloader, "offload", second_fails)
    for number in range(1, 3):
        assert_bitwise(ref, run_step(model, inputs, offload, loss_fn=mean))
        # The first went out; the second could not, so it and the rest were summed in order.
        assert offload.stats.relieved_partials == number
    assert len(calls) == 4  # two tries a step: none after the one that failed
    assert spill_files(spill_dir) == []
    offload.close()


def test_partials_of_a_failed_backward_are_freed(spill_dir):
    trace = _trace()
    plan = _everything_out(trace, trace.junction_ordinals())
    model, inputs = Residual(), (torch.randn(1, 3, 256, 256),)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, tier="disk", spill_dir=spill_dir)

    def fail(grad):
        raise KeyboardInterrupt

    def watch(module, args, out):
        out.register_hook(fail)  # in block 0's backward: its junction holds a partial then

    model.blocks[0].a.register_forward_hook(watch)
    with pytest.raises(KeyboardInterrupt), offload:
        model(*inputs).mean().backward()
    assert offload.stats.relieved_partials == 4
    assert spill_files(spill_dir) == []


SCRIPT = MODEL + textwrap.dedent(
    """
    import json, sys, lms
    from lms.analysis import simulate, trace_step
    from lms.harness.memory import PeakMemory
    from lms.core.plan import Plan
    from lms.orchestration.local import local_device_spec

    torch.manual_seed(0)
    fmt = torch.channels_last  # the layout the CPU convolutions work in: no hidden copies
    model = globals()[sys.argv[2]]().to(memory_format=fmt)
    x = torch.randn(1, 3, 768, 768).contiguous(memory_format=fmt)
    trace = trace_step(model, [x], step, device="cpu")
    n = len(trace.entries())
    results = {}
    for mode in ("hold", "relieve"):  # heap bytes in use: the first run leaves the second alone
        meeting = trace.junction_ordinals() if mode == "relieve" else {}
        plan = Plan(fingerprint=trace.fingerprint(), offload=tuple(range(n)), num_entries=n,
                    swapin_ahead=1, sync_mode=3, relieved_junctions=tuple(meeting),
                    relieved_partials=tuple(j.partials for j in meeting.values()))
        sim = simulate(trace, plan, local_device_spec(torch.device("cpu")))
        at_start, peak = sim.peak_after(sim.backward_start_s)
        offload = lms.LMS(plan=plan, tier="disk", spill_dir=sys.argv[1])
        peaks = []
        for _ in range(2):  # backward is where junctions are: its growth over its start
            model.zero_grad(set_to_none=True)
            with offload:
                loss = model(x).mean()
                with PeakMemory() as memory:
                    loss.backward()
            peaks.append(memory.growth_bytes)
        results[mode] = {"measured": min(peaks[1:]), "simulated": peak - at_start,
                         "relieved": offload.stats.relieved_partials}
        offload.close()
    print(json.dumps(results))
    """
)


def _measure(folder, model):
    return script_json(SCRIPT, folder, model)


@pytest.mark.serial
@pytest.mark.parametrize(
    ("model", "partials"),
    [("Residual", 4), ("Fan", 3)],  # 4 junctions of two; one of three
)
def test_relieved_junctions_lower_measured_backward_memory_as_simulated(tmp_path, model, partials):
    activation = 16 * 768 * 768 * 4
    measured = _measure(tmp_path, model)
    held, relieved = measured["hold"], measured["relieve"]
    assert relieved["relieved"] == 2 * partials  # 2 steps
    assert held["measured"] - relieved["measured"] >= 0.8 * activation, (held, relieved)
    for result in (held, relieved):
        assert abs(result["measured"] / result["simulated"] - 1) <= 0.10, result


class SplitLoss(nn.Module):
    """``t`` feeds two ops in branch ``a`` and, when ``third``, one more in branch ``b``; backward
    runs ``a`` first, where a walk from its first node sees only two consumers of ``t``."""

    def __init__(self, third):
        super().__init__()
        self.lin, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.third = third

    def forward(self, x):
        t = self.lin(x)
        b = self.b(t if self.third else x).exp().sum()
        a = (t * torch.tanh(t)).sum()  # made last: backward runs it first
        return a + b


@pytest.mark.parametrize("third", [False, True])
def test_trace_counts_consumers_in_branches_backward_runs_apart(third):
    def loss_step(model, batch):
        loss = model(*batch)
        loss.backward()
        return loss

    trace = trace_step(
        lambda: SplitLoss(third), [torch.randn(512, 64)], loss_step, min_offload_bytes=0
    )
    t_bytes = 512 * 64 * 4
    (found,) = [j for j in trace.junctions if j.sizes[0] == t_bytes]
    assert found.partials == (3 if third else 2)


class SumApart(nn.Module):
    """``t`` also feeds a sum in a branch where no op saves a tensor: no walk down from a saved
    tensor's node reaches that consumer, so the runtime counts one partial fewer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        t = self.lin(x)
        s = t.sum()  # made first: backward runs it last, after the first saved tensor is read
        return s + (t * torch.tanh(t)).sum()


def test_trace_leaves_out_a_junction_the_runtime_cannot_count(spill_dir):
    def loss_step(model, batch):
        loss = model(*batch)
        loss.backward()
        return loss

    x = torch.randn(512, 64)
    trace = trace_step(SumApart, [x], loss_step, min_offload_bytes=0)
    t_bytes = 512 * 64 * 4
    assert not [j for j in trace.junctions if j.sizes[0] == t_bytes]
    # What the runtime does with a plan that names the three partials forward made at t (and,
    # not knowing which entry is t, at every entry of its size): it counts two at t, hooks
    # nothing, and autograd sums them.
    named = tuple(i for i, (_, size, _) in enumerate(trace.entries()) if size == t_bytes)
    n = len(trace.entries())
    plan = Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(range(n)),
        num_entries=n,
        relieved_junctions=named,
        relieved_partials=(3,) * len(named),
    )
    torch.manual_seed(0)
    model = SumApart()
    ref = run_step(model, (x,), loss_fn=lambda out: out)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    assert_bitwise(ref, run_step(model, (x,), offload, loss_fn=lambda out: out))
    assert offload.stats.relieved_partials == 0
    offload.close()


@pytest.mark.parametrize("third", [False, True])
def test_runtime_finds_consumers_in_branches_backward_runs_apart(spill_dir, third):
    def loss_step(model, batch):
        loss = model(*batch)
        loss.backward()
        return loss

    x = torch.randn(512, 64)
    trace = trace_step(lambda: SplitLoss(third), [x], loss_step, min_offload_bytes=0)
    meeting = trace.junction_ordinals()
    n = len(trace.entries())
    plan = Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(range(n)),
        num_entries=n,
        relieved_junctions=tuple(meeting),
        relieved_partials=tuple(j.partials for j in meeting.values()),
    )
    torch.manual_seed(0)
    model = SplitLoss(third)
    ref = run_step(model, (x,), loss_fn=lambda out: out)
    offload = lms.LMS(plan=plan, min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    assert_bitwise(ref, run_step(model, (x,), offload, loss_fn=lambda out: out))
    assert offload.stats.relieved_partials == sum(j.taken for j in meeting.values())
    assert offload.stats.relieved_partials >= (3 if third else 1)
    offload.close()
