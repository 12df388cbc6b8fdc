"""Losses and gradients with everything offloaded equal the plain step bit for bit."""

import contextlib
import pathlib
import runpy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import lms
from tests.conftest import assert_bitwise, assert_followed, run_step, same_bits, spill_files


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Zoo(nn.Module):
    """A little of everything: in-place ops, views, a tensor saved twice, a custom Function."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        y = y * y  # the same tensor saved twice
        y.add_(1.0)  # in place on an unsaved result
        v = y.view(y.shape[0], 8, 64, 64).transpose(2, 3)  # views of one storage
        z = Square.apply(v[:, :, :, :32]) + v[:, :, :, 32:].sigmoid()
        z = self.drop(z)
        return self.fc(z.reshape(z.shape[0], -1, 64)).tanh()


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.b = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x):
        x = checkpoint(self.a, x, use_reentrant=False)
        return self.b(x.relu())


def make(name):
    torch.manual_seed(0)
    if name == "zoo":
        return Zoo(), (torch.randn(2, 3, 64, 64),)
    if name in ("LSTM", "GRU", "RNN"):
        return Recurrent(name), (torch.randn(3, 20, 16),)
    if name == "checkpoint":
        return Checkpointed(), (torch.randn(32, 64),)
    raise KeyError(name)


POLICIES = {
    "all-to-disk": dict(swapout_threshold=1, min_offload_bytes=0, tier="disk"),
    "all-to-host": dict(swapout_threshold=1, min_offload_bytes=0, tier="host"),
    "budget-disk": dict(budget="48KiB", min_offload_bytes=0, tier="disk"),
    "threshold-5-sync": dict(swapout_threshold=5, min_offload_bytes=0, tier="disk", sync_mode=3),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", ["zoo", "LSTM", "GRU", "checkpoint"])
def test_bitwise_equal_over_steps(name, policy, spill_dir):
    model, inputs = make(name)
    ref = run_step(model, inputs)
    offload = lms.LMS(spill_dir=spill_dir, **POLICIES[policy])
    for _ in range(3):  # the first step is recorded, later ones decide at save time
        assert_bitwise(ref, run_step(model, inputs, offload))
    assert offload.stats.offloaded_tensors > 0
    assert offload.stats.reloaded_bytes >= offload.stats.offloaded_bytes // 3
    offload.close()


def test_everything_reachable_is_offloaded(spill_dir):
    model, inputs = make("zoo")
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    run_step(model, inputs, offload)
    stats = offload.stats
    assert stats.offloaded_bytes == stats.saved_bytes
    assert stats.peak_resident_saved_bytes == 0
    # parameters and BatchNorm's buffers are the only tensors kept
    assert stats.kept_tensors > 0


def test_bf16_autocast(spill_dir):
    model, inputs = make("zoo")

    def step(ctx=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_step(model, inputs, ctx)

    ref = step()
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    assert_bitwise(ref, step(offload))
    assert_bitwise(ref, step(offload))
    assert offload.stats.offloaded_tensors > 0


def test_retain_graph_backward_twice(spill_dir):
    model, inputs = make("zoo")
    ref = run_step(model, inputs, retain=True)
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    got = run_step(model, inputs, offload, retain=True)
    assert_bitwise(ref, got)
    # the second backward read (nearly) everything back a second time
    assert offload.stats.reloaded_bytes > 1.5 * offload.stats.offloaded_bytes


def test_a_tuned_step_that_differentiates_its_batch_follows_its_plan(spill_dir):
    # an input's saliency, an adversarial example's gradient: the batch requires a gradient,
    # which the trace keeps, so the plan's saves are the step's
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(8):
        layers += [nn.Tanh(), nn.Conv2d(16, 16, 3, padding=1)]
    model = nn.Sequential(*layers)
    x = torch.randn(2, 3, 128, 128)

    def step(m, batch):
        loss = m(batch[0]).square().mean()
        loss.backward()
        return loss

    ref_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = run_step(model, [ref_x])
    offload = lms.LMS(budget="50%", tier="disk", spill_dir=spill_dir, slabs=False)
    plan = offload.tune(model, [got_x], step)
    got = run_step(model, [got_x], offload)
    assert_followed(plan, offload.stats, steps=1)
    assert_bitwise(ref, got)
    assert same_bits(ref_x.grad, got_x.grad)


def _square_step(model, batch):
    """`run_step`'s step."""
    model(*batch).float().square().mean().backward()


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_a_cell_loop_follows_a_plan_that_offloads_its_gates(kind, spill_dir):
    """Note [A storage copied again keeps its place in the plan]: the chunks of a gates storage
    the plan offloads, saved after it went out, are copied again under its ordinal, and the
    step keeps to the plan (it left it at its first cell before)."""
    from lms.analysis import device_spec, trace_step
    from lms.planning.candidates import Candidates

    loop = runpy.run_path(str(pathlib.Path(__file__).parents[2] / "benchmarks/cell_loops.py"))
    torch.manual_seed(0)
    model, x = loop["CellLoop"](kind), torch.randn(6, 256, 64)
    ref = run_step(model, [x])
    trace = trace_step(model, [x], _square_step, device="cpu", min_offload_bytes=0)
    candidates = Candidates(trace, device_spec("cpu"), budget_bytes=2**40)
    plan = candidates.plan(range(candidates.num_entries), source="test")
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(ref, run_step(model, [x], offload))
    assert plan.offload and offload.stats.diverged_steps == 0
    assert offload.stats.offloaded_tensors > 2 * len(plan.offload)  # the twins' copies too
    offload.close()
    assert spill_files(spill_dir) == []


def test_backward_after_the_block(spill_dir):
    model, inputs = make("zoo")
    ref = run_step(model, inputs)
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with offload:
        loss = model(*inputs).float().square().mean()
    loss.backward()
    assert_bitwise(ref, (loss.detach(), [p.grad for p in model.parameters()]))


def test_no_offload_region_keeps_tensors(spill_dir):
    model, inputs = make("zoo")
    ref = run_step(model, inputs)
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    with lms.no_offload():
        got = run_step(model, inputs, offload)
    assert_bitwise(ref, got)
    assert offload.stats.offloaded_tensors == 0
    assert offload.stats.kept_tensors == offload.stats.saved_tensors


def _changed_after_save(x):
    y = x.exp()  # exp saves its output y, sin saves y as its input
    z = y.sin()
    y[:8].mul_(2)  # in place, through a view, on a tensor already saved twice
    return z.sum() + y.sum()


@pytest.mark.parametrize(
    "settings",
    [
        dict(swapout_threshold=1, min_offload_bytes=0, tier="disk"),
        dict(swapout_threshold=1, min_offload_bytes=0, tier="host"),
        dict(min_offload_bytes="1MiB", tier="disk"),  # kept in place
    ],
    ids=["disk", "host", "kept"],
)
def test_a_saved_tensor_changed_in_place_is_refused_as_autograd_refuses_it(settings, spill_dir):
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _changed_after_save(x).backward()
    offload = lms.LMS(spill_dir=spill_dir, **settings)
    changed = pytest.raises(lms.SavedTensorChangedError, match="at version 1, saved at version 0")
    with changed, offload:
        _changed_after_save(x).backward()
    assert offload.stats.offloaded_tensors == (0 if "swapout_threshold" not in settings else 1)
    # the same step without the in-place change runs, and the runtime is left clean
    with offload:
        x.exp().sin().sum().backward()
    assert spill_files(spill_dir) == []
    offload.close()


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "offloaded"])
def test_an_output_backward_never_reaches_is_freed_with_its_step(kept, spill_dir):
    # softmax saves its own output; a save that held the output itself would close a cycle
    # through autograd's node that nothing collects (Note [A kept save holds no reference cycle])
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 1))
    settings = (
        dict(min_offload_bytes="1GiB") if kept else dict(swapout_threshold=1, min_offload_bytes=0)
    )
    offload = lms.LMS(spill_dir=spill_dir, tier="disk", **settings)
    unused = []
    for _ in range(3):
        with offload:
            hidden = model[0](torch.randn(32, 64))
            unused.append(weakref.ref(hidden.softmax(-1)))  # a metric, say: never in the loss
            model[1](hidden.relu()).sum().backward()
    gc.collect()
    assert [ref() for ref in unused] == [None] * 3
    offload.close()


def test_shared_storage_goes_out_once(spill_dir):
    x = torch.randn(256, 256, requires_grad=True)
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    with offload:
        y = x.exp()
        z = (y * y).sum() + y.t().sin().sum() + y[:10].cos().sum()
        z.backward()
    ref = x.exp()
    expected = 2 * ref * ref + ref.t().cos().t() * ref
    expected[:10] -= ref[:10].sin() * ref[:10]
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-5)
    # y's storage was saved by exp, mul (twice), t and a slice: one copy out
    assert offload.stats.offloaded_bytes == 256 * 256 * 4
    assert offload.stats.offloaded_tensors == 1


def test_min_offload_bytes_keeps_small_tensors(spill_dir):
    model, inputs = make("zoo")
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes="1MiB", spill_dir=spill_dir)
    run_step(model, inputs, offload)
    assert offload.stats.offloaded_tensors == 0


def test_budget_keeps_newest_resident(spill_dir):
    torch.manual_seed(0)
    layers = [nn.Linear(512, 512) for _ in range(8)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    inputs = (torch.randn(512, 512),)
    ref = run_step(model, inputs)
    act = 512 * 512 * 4
    start = 8 * (512 * 512 + 512) * 4 + act  # the weights and the batch
    offload = lms.LMS(budget=start + 7 * act, spill_dir=spill_dir)  # allowance: 4 activations
    for _ in range(2):
        assert_bitwise(ref, run_step(model, inputs, offload))
    assert offload.stats.offloaded_tensors > 0
    assert offload.stats.peak_resident_saved_bytes <= 4 * act
    assert offload.stats.prefetched_bytes > 0


class Scaled(nn.Module):
    """A buffer that forward saves (a product's other factor)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 256)
        self.register_buffer("scale", torch.full((512, 256), 0.5))

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.scale)


def test_a_named_model_is_kept_without_a_hook_on_every_module_call(spill_dir):
    from torch.nn.modules import module

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(512, 64)
    hooked, kept = [], []
    model.lin.register_forward_pre_hook(
        lambda *_: hooked.append(bool(module._global_forward_pre_hooks))
    )
    ref = run_step(model, (x,))
    for named in (None, model):
        offload = lms.LMS(
            swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir, model=named
        )
        assert_bitwise(ref, run_step(model, (x,), offload))
        kept.append(offload.stats.kept_tensors)
        assert offload.stats.offloaded_tensors > 0
    assert hooked == [False, True, False]  # plain, then found by the hook, then named
    assert kept[0] == kept[1] > 0  # the buffer and the weight stay either way
    model.compile(backend="aot_eager")
    ref = run_step(model, (x,))
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir, model=model)
    for _ in range(2):
        assert_bitwise(ref, run_step(model, (x,), offload))
    with pytest.raises(TypeError, match="model= takes modules"):
        lms.LMS(model=[model, "head"])


def _middle(conv, x):
    return torch.sin(conv(x)) * x


_compiled_middle = torch.compile(_middle)


class _Middle(nn.Module):
    """Calls `_middle`, compiled or not, through a global: nothing on the module shows which."""

    def __init__(self, conv, compiled):
        super().__init__()
        self.conv, self.compiled = conv, compiled

    def forward(self, x):
        return (_compiled_middle if self.compiled else _middle)(self.conv, x)


def _conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.SiLU(),
        nn.Flatten(),
        nn.Linear(16 * 32 * 32, 10),
    )


# serial: which plan wins rests on this CPU's rates, measured while the test runs
@pytest.mark.serial
@pytest.mark.parametrize("where", ["model", "forward", "step", "function"])
def test_a_compiled_model_is_tuned_without_replays_and_stays_bitwise(
    where, spill_dir, monkeypatch, caplog
):
    import dataclasses

    import torch._dynamo

    from lms.core.devices import DEVICES
    from lms.orchestration import local

    # With the write log free (Note [The write log's own cost]) and copies slower than this
    # machine's spill files may measure, the eager model's plan recomputes
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(DEVICES["cpu"], write_log_op_s=0))
    measured = local._local_cpu_spec
    monkeypatch.setattr(
        local,
        "_local_cpu_spec",
        lambda: dataclasses.replace(measured(), d2h_gbps=0.5, h2d_gbps=0.5, fresh_read_gbps=None),
    )

    def step(model, batch):
        loss = model(*batch).float().square().mean()
        loss.backward()
        return loss

    def run(model, step, ctx=None):
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = step(model, [x])
        return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]

    x = torch.randn(8, 3, 32, 32)
    plans = []
    for compiled in (False, True):
        torch._dynamo.reset()  # past its recompile limit, dynamo would run the model eagerly
        model, compiled_step = _conv_net(), step
        # inductor: its kernels round otherwise than eager aten calls
        if where == "function":  # a function the model calls, compiled or not
            model[3] = _Middle(model[3], compiled)
        if compiled and where == "model":
            model.compile()
        elif compiled and where == "forward":
            model.forward = torch.compile(model.forward)
        elif compiled and where == "step":
            compiled_step = torch.compile(step)
        ref = run(model, compiled_step)
        offload = lms.LMS(budget="4.25MiB", tier="disk", spill_dir=spill_dir, model=model)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lms"):
            plans.append(offload.tune(model, [x], compiled_step, cache_dir=spill_dir))
        # Note [A compiled graph saves when it ends]: said before the first step
        assert ("The model or the step is compiled" in caplog.text) == compiled
        assert_bitwise(ref, run(model, compiled_step))  # tuning left the compiled code as it was
        for _ in range(2):
            assert_bitwise(ref, run(model, compiled_step, offload))
        assert offload.stats.offloaded_tensors == 2 * len(plans[-1].offload)
        offload.close()
    assert plans[0].recompute and not plans[1].recompute  # a replay would run it uncompiled
    assert plans[0].fingerprint != plans[1].fingerprint


def test_compiled_model_bitwise(spill_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh())
    model.compile(backend="aot_eager")  # in place: no warning about global module hooks
    compiled = model
    x = torch.randn(512, 64)
    ref = run_step(compiled, (x,))
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir, tier="disk")
    for _ in range(2):
        assert_bitwise(ref, run_step(compiled, (x,), offload))
    assert offload.stats.offloaded_tensors > 0
    offload.close()


def check_a_subclass_moves_by_its_inner_tensors(device, retain=False, **settings):
    """Two steps of products and tanh over tensors that wrap two tensors each (Note [Subclasses
    move by their inner tensors]), under LMS: bitwise those of the plain step."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    generator = torch.Generator().manual_seed(0)

    def pair(*shape):
        made = (torch.randn(*shape, generator=generator).to(device) for _ in "ab")
        return two_tensor.TwoTensor(*made)

    x = pair(64, 128)
    weights = [pair(128, 256).requires_grad_(), pair(256, 32).requires_grad_()]

    def step(ctx):
        for weight in weights:
            weight.grad = None
        with ctx:
            loss = ((x @ weights[0]).tanh() @ weights[1]).square().mean()
            loss.backward(retain_graph=retain)
            if retain:
                loss.backward()
        return [part.clone() for w in weights for part in (w.grad.a, w.grad.b)]

    ref = step(contextlib.nullcontext())
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, **settings)
    for _ in range(2):
        assert all(same_bits(a, b) for a, b in zip(ref, step(offload), strict=True))
    # each step moves two storages for each of tanh's output and the second product's, and the
    # batch's in the first step only (the caller holds it); the second weight, saved by the
    # product that reads it, stays (the first is not saved: nothing needs the batch's gradient)
    assert offload.stats.offloaded_tensors == 6 + 4
    assert offload.stats.kept_tensors == 2
    offload.close()


@pytest.mark.parametrize("retain", [False, True], ids=["once", "retain_graph"])
def test_a_subclass_wrapping_tensors_moves_them_and_comes_back_bitwise(retain, spill_dir):
    check_a_subclass_moves_by_its_inner_tensors("cpu", retain, spill_dir=spill_dir)
    assert spill_files(spill_dir) == []


def test_a_subclass_wrapping_tensors_changed_in_place_is_refused(spill_dir):
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    x = two_tensor.TwoTensor(torch.randn(256, 256), torch.randn(256, 256)).requires_grad_()
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    with pytest.raises(lms.SavedTensorChangedError), offload:
        _changed_after_save(x).backward()
    assert offload.stats.offloaded_tensors == 2
    offload.close()
    assert spill_files(spill_dir) == []


def test_a_subclass_saved_inside_no_offload_stays_whole(spill_dir):
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    x = two_tensor.TwoTensor(torch.randn(256, 256), torch.randn(256, 256)).requires_grad_()
    offload = lms.LMS(swapout_threshold=1, min_offload_bytes=0, spill_dir=spill_dir)
    with offload, lms.no_offload():
        x.exp().sin().sum().backward()
    assert offload.stats.offloaded_tensors == 0
    assert offload.stats.kept_tensors == offload.stats.saved_tensors == 2
    offload.close()


def test_the_allocators_retries_during_a_step_are_counted_and_said_once(
    spill_dir, monkeypatch, caplog
):
    """Note [The allocator gives memory back]: the CUDA allocator's retries (its count, stood in
    for here) that happen inside a step are the step's: counted in the stats, said once."""
    from lms.runtime import session

    counter = iter(range(0, 100, 3))  # each read, three retries more than the last
    monkeypatch.setattr(session, "allocator_now", lambda: (0, 0, next(counter)))
    model, inputs = make("checkpoint")
    offload = lms.LMS(spill_dir=spill_dir, **POLICIES["budget-disk"])
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            run_step(model, inputs, offload)
    assert offload.stats.allocator_retries == 6
    said = [r for r in caplog.records if "caching allocator" in r.getMessage()]
    assert len(said) == 1 and "step 1" in said[0].getMessage()
