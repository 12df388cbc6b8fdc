"""Ops timed alone on the device (Note [Ops timed on the device]): each distinct call once, what
cannot run left to the rates, the random streams untouched, and the simulator taking the times
for the trace timed alone."""

import dataclasses
import json
import logging
import queue
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lms.analysis import trace_step
from lms.analysis.recorder import _as_meta
from lms.analysis.simulate import library_kept_bytes, op_seconds, simulate
from lms.core.devices import DEVICES, FRESH_PAGES_BYTES, MAPPED_ALONE_BYTES, OpTimings
from lms.core.errors import PlanInfeasibleError
from lms.core.records import OpCall, TensorMeta
from lms.orchestration import local, timing, tuning
from lms.orchestration.timing import time_ops
from lms.runtime import heap

CPU = torch.device("cpu")


def _net(width=32, depth=3):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.5)]
    return torch.nn.Sequential(*layers)


def _trace(model, batch=8, width=32):
    return trace_step(model, lambda: (torch.randn(batch, width),), device=CPU)


def test_each_distinct_call_is_timed_once_and_alike_calls_share_its_time(monkeypatch):
    trace = _trace(_net())
    sent = []

    def child(jobs, device, limit_s, mapped_bytes=None):
        sent.extend(jobs)
        return {position: (1e-3 * (position + 1), None, 0) for position in range(len(jobs))}

    monkeypatch.setattr(timing, "_time_in_child", child)
    timings = time_ops(trace, CPU)
    keys = {c.key for c in trace.calls if not c.op.is_view}
    assert len(sent) == len(keys) and [name for name, _, _ in sent].count("aten.addmm.default") == 1
    by_key: dict[str, set[float | None]] = {}
    for call, seconds in zip(trace.calls, timings.seconds, strict=True):
        by_key.setdefault(call.key, set()).add(seconds)
        assert seconds == 0.0 if call.op.is_view else seconds >= 1e-3
    assert all(len(times) == 1 for times in by_key.values())
    # the three linear layers are one call
    linear = [c for c in trace.calls if str(c.op) == "aten.addmm.default"]
    assert len(linear) == 3 and len({c.key for c in linear}) == 1
    assert timings.fingerprint == trace.fingerprint() and timings.timed == len(trace.ops)


def test_ops_are_timed_in_a_process_of_their_own():
    trace = _trace(_net())
    names = {op.name for op in trace.ops}
    ran = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(str(func))
            return func(*args, **(kwargs or {}))

    with Watch():
        timings = time_ops(trace, CPU)
    assert not names & set(ran)  # none of the step's ops ran here
    assert timings.timed == len(trace.ops)
    assert all(s > 0 for s, c in zip(timings.seconds, trace.calls, strict=True) if not c.op.is_view)


@pytest.mark.parametrize(
    ("child", "said"),
    [
        (
            (
                sys.executable,
                "-c",
                "import pickle, sys; pickle.load(sys.stdin.buffer); sys.exit(3)",
            ),
            "ended with code 3 after 0 of",
        ),
        (("/nonexistent/python",), "No process could time ops"),
    ],
    ids=["dies", "cannot-start"],
)
def test_a_timing_process_that_fails_leaves_the_rates(monkeypatch, caplog, child, said):
    trace = _trace(_net())
    monkeypatch.setattr(timing, "_CHILD", child)
    with caplog.at_level(logging.WARNING, logger="lms"):
        timings = time_ops(trace, CPU)
    assert said in caplog.text
    for taken, call in zip(timings.seconds, trace.calls, strict=True):
        assert taken == (0.0 if call.op.is_view else None)
    spec = DEVICES["cpu"]
    rates = op_seconds(trace, spec, False)
    got = op_seconds(trace, spec.with_op_timings(timings), False)
    for call, mine, theirs in zip(trace.calls, got, rates, strict=True):
        assert mine == (spec.op_overhead_s if call.op.is_view else theirs)


def test_timing_draws_nothing_from_the_random_streams():
    trace = _trace(_net())
    assert any("dropout" in op.name or "bernoulli" in op.name for op in trace.ops)
    torch.manual_seed(7)
    time_ops(trace, CPU)
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


def test_measuring_this_cpu_draws_nothing_from_the_random_streams(monkeypatch):
    """A tune measures the CPU's rates in the step's own process, before its first step: a
    draw from the generator the user seeded would change that step's dropout."""
    monkeypatch.setattr(local, "_MEASURED_CPU", {})
    torch.manual_seed(7)
    local._local_cpu_spec()
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


def test_calls_that_cannot_run_here_keep_the_rates(caplog):
    trace = _trace(_net(width=256), batch=64, width=256)
    largest = max(range(len(trace.ops)), key=lambda i: trace.ops[i].working_set_bytes)
    refusing = OpCall(
        torch.ops.aten._assert_async.default, (TensorMeta((), (), torch.bool, "cpu"),), {}
    )
    calls = list(trace.calls)
    first_mm = next(i for i, c in enumerate(calls) if str(c.op) == "aten.mm.default")
    calls[first_mm] = refusing  # zeros: False, which it refuses
    cap = trace.ops[largest].working_set_bytes - 1
    with caplog.at_level(logging.INFO, logger="lms"):
        timings = time_ops(dataclasses.replace(trace, calls=tuple(calls)), CPU, max_bytes=cap)
    assert timings.seconds[first_mm] is None
    too_large = [i for i, op in enumerate(trace.ops) if op.working_set_bytes > cap]
    assert largest in too_large and all(timings.seconds[i] is None for i in too_large)
    assert "refused made-up data" in caplog.text and "1 refused" in caplog.text
    spec = local.local_device_spec(CPU)
    rates = op_seconds(trace, spec, False)
    timed = op_seconds(trace, spec.with_op_timings(timings), False)
    for i in (first_mm, *too_large):
        assert timed[i] == rates[i]
    # none timed after the time allowed: every op but the views keeps the rates
    late = time_ops(trace, CPU, limit_s=0.0)
    assert all(
        s == (0.0 if c.op.is_view else None) for s, c in zip(late.seconds, trace.calls, strict=True)
    )


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_timing_process_chooses_kernels_as_the_step_does(deterministic):
    """TF32, cuDNN's benchmarking and deterministic algorithms go to the timing process: here
    an op without a deterministic kernel, which raises there only where it would in the step."""
    put = (
        "aten.put_.default",
        tuple(
            TensorMeta((n,), (1,), dtype, "cpu")
            for n, dtype in ((4, torch.float32), (2, torch.int64), (2, torch.float32))
        ),
        {},
    )
    before = timing.backend_settings()
    try:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision("medium")
        sent = timing.backend_settings()
        results = timing._time_in_child([put], CPU, limit_s=30.0)
    finally:
        timing.apply_backend_settings(before)
    assert sent["matmul_precision"] == "medium" and timing.backend_settings() == before
    assert set(results) == {0} and (results[0] is None) == deterministic


def test_calls_that_name_a_memory_format_are_timed():
    """Note [Memory formats go by name]: the timing process gets each format by its name."""
    assert timing._sendable(torch.channels_last) == timing._MemoryFormat("channels_last")
    x = TensorMeta((8, 8), (8, 1), torch.float32, "cpu")
    calls = [
        ("aten.clone.default", (x,), {"memory_format": torch.contiguous_format}),
        ("aten.clone.default", (x,), {"memory_format": torch.preserve_format}),
    ]
    results = timing._time_in_child(calls, CPU, limit_s=30.0)
    assert set(results) == {0, 1} and None not in results.values(), results


def test_attentions_dropout_state_is_made_up_on_the_host():
    """An attention backward reads its dropout's seed and offset on the host, as its forward
    returns them; the trace has them on the step's device. Made up there on a card, the timing
    process died. Here the step's device is the meta device, standing for a card."""
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    qkv = TensorMeta((2, 4, 64, 16), (4096, 1024, 16, 1), torch.float32, "meta")
    lse = TensorMeta((2, 4, 64), (256, 64, 1), torch.float32, "meta")
    scalar = TensorMeta((), (), torch.int64, "meta")
    args = (qkv, qkv, qkv, qkv, None, qkv, lse, scalar, scalar, 0.1, [True, True, True, False])
    made, kwargs = timing._made_up_call(op, args, {"scale": None}, torch.device("meta"))
    assert [t.device.type for t in made[7:9]] == ["cpu", "cpu"]
    assert {t.device.type for t in (*made[:4], *made[5:7])} == {"meta"}
    assert made[9:] == args[9:] and made[4] is None and kwargs == {"scale": None}
    # flash attention's state on an NVIDIA card, two unsigned words, stays on the card
    flash = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    state = TensorMeta((2,), (1,), torch.uint64, "meta")
    offset = TensorMeta((), (), torch.uint64, "meta")
    args = (qkv, qkv, qkv, qkv, qkv, lse, None, None, 64, 64, 0.1, False, state, offset)
    made, _ = timing._made_up_call(flash, args, {}, torch.device("meta"))
    assert [t.device.type for t in made[12:]] == ["meta", "meta"]


@pytest.mark.parametrize("dims", [2, 3])
def test_a_max_poolings_backward_is_timed_on_the_indices_its_forward_picks(dims):
    """Made up as zeros, a max pooling's indices sent every gradient to one place, where a card
    adds them one at a time: a 3D U-Net's first pooling backward was timed on an H200 at 110.6 ms
    where its step ran it in 1.8 ms. They are what the forward picks from the made-up input:
    here each window's own place."""
    spatial = (16,) * dims
    half = (2, 4, *(n // 2 for n in spatial))
    x, grad = _as_meta(torch.empty(2, 4, *spatial)), _as_meta(torch.empty(half))
    picked = _as_meta(torch.empty(half, dtype=torch.int64))
    op = getattr(torch.ops.aten, f"max_pool{dims}d_with_indices_backward").default
    pool = [2] * dims, [2] * dims, [0] * dims, [1] * dims, False
    args, _ = timing._made_up_call(op, (grad, x, *pool, picked), {}, CPU)
    indices = args[-1]
    expected = getattr(torch.ops.aten, f"max_pool{dims}d_with_indices")(args[1], *pool)[1]
    assert torch.equal(indices, expected)
    assert indices[0, 0].unique().numel() == indices[0, 0].numel()  # a place for each window
    adaptive = getattr(torch.ops.aten, f"adaptive_max_pool{dims}d_backward").default
    args, _ = timing._made_up_call(adaptive, (grad, x, picked), {}, CPU)
    assert args[-1][0, 0].unique().numel() == args[-1][0, 0].numel()


def test_an_lstm_backward_is_timed_on_the_workspace_its_forward_makes():
    """The trace records oneDNN's LSTM workspace with no bytes; made up so, the backward read
    past it and the timing process died on it (a segmentation fault), leaving it to the rates."""

    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(16, 32, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    trace = trace_step(Recurrent, lambda: (torch.randn(4, 50, 16),), device=CPU)
    [call] = [c for c in trace.calls if str(c.op) == "aten.mkldnn_rnn_layer_backward.default"]
    job = (str(call.op), call.args, call.kwargs)
    results = timing._time_in_child([job], CPU, limit_s=30.0)
    assert results[0] is not None and results[0][0] > 0, results


def test_the_simulator_takes_the_times_for_the_trace_timed_alone():
    trace = _trace(_net())
    other = _trace(_net(), batch=16)
    spec = DEVICES["cpu"]
    seconds = tuple(1e-3 * (i + 1) for i in range(len(trace.ops)))
    timed = spec.with_op_timings(OpTimings(fingerprint=trace.fingerprint(), seconds=seconds))
    got = op_seconds(trace, timed, False)
    assert got == pytest.approx([spec.op_overhead_s + s for s in seconds], rel=1e-12)
    assert simulate(trace, None, timed).base_step_s == pytest.approx(sum(got), rel=1e-9)
    # another trace (another batch), or one of another length, is priced by the rates
    assert op_seconds(other, timed, False) == op_seconds(other, spec, False)
    short = OpTimings(fingerprint=trace.fingerprint(), seconds=seconds[:-1])
    assert op_seconds(trace, spec.with_op_timings(short), False) == op_seconds(trace, spec, False)
    # the spec stays a cheap key that keeps its identity
    assert hash(timed) == hash(timed) and timed != spec and "op_timings" not in repr(timed)


class _Atrous(torch.nn.Module):
    """DeepLabV3's atrous pooling at a small input: a 3x3 convolution dilated past its input,
    whose backward takes several times the scratch `_cpu_scratch` estimates."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(960, 256, 3, padding=12, dilation=12, bias=False)

    def forward(self, x):
        return self.conv(x)


def test_an_ops_scratch_is_measured_where_it_is_timed(caplog):
    """Note [An op's scratch, measured where it is timed]: the heap's rise while the op runs,
    less its outputs; a reduction takes next to none."""
    x = torch.randn(2, 960, 16, 16, requires_grad=True)
    trace = trace_step(_Atrous(), (x,), device=CPU)
    with caplog.at_level(logging.INFO, logger="lms"):
        timings = time_ops(trace, CPU, mapped_bytes=MAPPED_ALONE_BYTES)
    assert len(timings.scratch) == len(trace.ops)
    by_name = {op.name: (op, timings.scratch[op.index]) for op in trace.ops}
    convolution, scratch = by_name["aten.convolution_backward.default"]
    # its input and weight gradients are 10.3 MiB; oneDNN's copies of them and of its operands
    # are at least as much again, whatever the kernel
    assert scratch is not None and scratch > 10 * 2**20, timings.scratch
    _, reduced = by_name["aten.mean.default"]
    assert reduced is not None and reduced < MAPPED_ALONE_BYTES
    # views are not run, and keep none
    views = [op.index for op in trace.ops if op.name == "aten.expand.default"]
    assert views and all(timings.scratch[i] is None for i in views)
    # the op furthest over its estimate is named, where it is a MiB over or more
    more = scratch - convolution.cpu_scratch_bytes
    named = "aten.convolution_backward.default at _Atrous.conv takes"
    assert (named in caplog.text) == (more >= MAPPED_ALONE_BYTES), caplog.text


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's buffers, measured")
def test_the_buffers_a_library_keeps_are_measured_once_a_call_and_left_room_for(
    monkeypatch, caplog
):
    """Note [Buffers a library keeps]: MKL keeps what a large matrix product packs its operands
    into; the timing process empties its pool, reads what each call's first run leaves behind,
    and a plan leaves their sum in the budget beside the step's own peak."""
    monkeypatch.setattr(local, "_TIMED", {})
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1)
    )
    trace = trace_step(model, lambda: (torch.randn(4096, 64),), device=CPU)
    timings = time_ops(trace, CPU)
    assert len(timings.kept) == len(trace.ops)
    first = next(op.index for op in trace.ops if op.name == "aten.addmm.default")
    # the first layer's product packs its 4096 x 64 by 64 x 1024 operands: megabytes kept
    assert (timings.kept[first] or 0) >= 2**20, timings.kept
    timed = DEVICES["cpu"].with_op_timings(timings)
    total = sum(n for n in timings.kept if n is not None and n >= 4096)
    assert library_kept_bytes(trace, timed) == total > 0
    assert library_kept_bytes(trace, DEVICES["cpu"]) == 0  # not measured: none counted
    assert OpTimings.from_dict(json.loads(json.dumps(timings.to_dict()))).kept == timings.kept
    # timed again, in the same waiting process, its pool emptied first: measured alike
    again = time_ops(trace, CPU)
    assert abs(sum(n or 0 for n in again.kept) - sum(n or 0 for n in timings.kept)) < 2**20
    # the plan holds the step's own peak to what the budget leaves beside the buffers; where
    # nothing fits that, to the budget, saying by how much the first step passes it
    from lms.planning import plan_auto
    from lms.planning.candidates import Candidates
    from lms.planning.minimum import smallest_plan

    _, smallest = smallest_plan(Candidates(trace, timed, budget_bytes=2**40))
    plain = simulate(trace, None, timed).peak_bytes
    roomy = (smallest.peak_bytes + plain) // 2 + total
    plan = tuning.within_room(plan_auto, trace, timed, roomy)
    assert simulate(trace, plan, timed).peak_bytes <= roomy - total
    tight = smallest.peak_bytes + total // 2
    with caplog.at_level(logging.WARNING, logger="lms"):
        plan = tuning.within_room(plan_auto, trace, timed, tight)
    assert simulate(trace, plan, timed).peak_bytes <= tight
    assert "the first step in a process passes it by up to those buffers" in caplog.text
    with pytest.raises(PlanInfeasibleError):  # below the floor itself
        tuning.within_room(plan_auto, trace, timed, smallest.peak_bytes - 2**20)


def test_a_sparse_outputs_parts_are_not_taken_for_scratch():
    """A sparse tensor's memory is its indices and values (Note [A sparse tensor is its parts]):
    a clone of one that holds 7.6 MiB of values makes them, and takes next to none beside."""
    indices = torch.tensor([[0, 1], [1, 0]])
    sparse = torch.sparse_coo_tensor(indices, torch.randn(2, 10**6), (2, 2, 10**6)).coalesce()
    op = torch.ops.aten.clone.default
    assert timing._scratch_taken(op, (sparse,), {}, CPU) < MAPPED_ALONE_BYTES


def test_an_op_whose_scratch_cannot_be_read_keeps_its_time(monkeypatch):
    def unreadable(*args):
        raise RuntimeError("a tensor without storage")

    monkeypatch.setattr(timing, "_scratch_taken", unreadable)
    x = TensorMeta((64, 64), (64, 1), torch.float32, "cpu")
    taken = timing._time_call("aten.mm.default", (x, x), {}, CPU)
    assert taken is not None and taken[0] > 0 and taken[1] is None


def test_the_simulator_takes_the_larger_of_measured_and_estimated_scratch():
    x = torch.randn(2, 960, 16, 16, requires_grad=True)
    trace = trace_step(_Atrous(), (x,), device=CPU)
    spec = DEVICES["cpu"]
    index = next(op.index for op in trace.ops if op.name == "aten.convolution_backward.default")
    estimated = trace.ops[index].cpu_scratch_bytes
    seconds = tuple(1e-3 for _ in trace.ops)

    def peak(at, scratch, which=spec):
        taken = [None] * len(trace.ops)
        taken[index] = scratch
        timed = OpTimings(trace.fingerprint(), seconds, scratch=tuple(taken))
        return simulate(trace, None, which.with_op_timings(timed)).peak_bytes

    plain = peak(index, None)
    measured = estimated + 64 * 2**20  # counted with room for the step's (1/32 more)
    assert peak(index, measured) == plain + measured + measured // 32 - estimated
    assert peak(index, estimated // 2) == plain  # the estimate stays the floor
    # a card's spec counts no CPU scratch, measured or estimated
    card = DEVICES["h100-80gb"]
    assert peak(index, 2**30, card) == peak(index, None, card)


def test_memory_an_empty_makes_is_priced_with_its_faults_though_timed():
    """Note [Memory made but not written is faulted in by its first writer]: a CPU dropout's
    mask is an `empty_like` filled in place; both are timed on memory whose pages are in."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Dropout(0.1))
    trace = trace_step(model, (torch.randn(512, 256),), device=CPU)
    spec = DEVICES["cpu"]  # faults its allocations of a MiB and more afresh
    seconds = tuple(1e-3 for _ in trace.ops)
    timed = spec.with_op_timings(OpTimings(trace.fingerprint(), seconds))
    got = op_seconds(trace, timed, False)
    names = [op.name for op in trace.ops]
    empty, fill = names.index("aten.empty_like.default"), names.index("aten.bernoulli_.float")
    mask = 512 * 1024 * 4  # 2 MiB
    assert got[empty] == pytest.approx(
        spec.op_overhead_s + 1e-3 + mask / (spec.fresh_memory_gbps * 1e9)
    )
    # what an op writes as it makes it is in its own time; an op in place makes nothing
    addmm = names.index("aten.addmm.default")
    assert got[addmm] == got[fill] == pytest.approx(spec.op_overhead_s + 1e-3)


def test_a_cpu_plan_is_tuned_on_the_times_of_its_own_ops(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(local, "_TIMED", {})
    model = _net(width=256)
    batch = (torch.randn(64, 256),)
    seen = []

    def planner(trace, spec, budget, **options):
        seen.append(spec.op_timings)
        from lms.planning import plan_auto

        return plan_auto(trace, spec, budget, **options)

    with caplog.at_level(logging.INFO, logger="lms"):
        tuning.tune_plan(
            model, batch, None, budget_bytes=2**30, min_offload_bytes=0, planner=planner
        )
        tuning.tune_plan(
            model, batch, None, budget_bytes=2**30, min_offload_bytes=0, planner=planner
        )
    assert len(seen) == 1 and seen[0] is not None and seen[0].timed > 0
    # the second found the first's plan in the cache, and timed nothing
    assert caplog.text.count("[LMS] Timed") == 1
    # tuned again in this process, the step is priced as before: its times are kept
    tuning.tune_plan(
        model, batch, None, budget_bytes=2**30 - 512, min_offload_bytes=0, planner=planner
    )
    tuning.tune_plan(
        model,
        batch,
        None,
        budget_bytes=2**30,
        min_offload_bytes=0,
        planner=planner,
        cache_dir=str(tmp_path),
    )
    assert len(seen) == 3 and seen[2] is seen[0] and seen[1] is not seen[0]


def test_a_gpu_plan_is_priced_at_its_ops_timed_on_the_card(monkeypatch):
    """Where the rates misprice a GPU's ops too (Note [Ops timed on the device]); timed again
    when the kernel settings change, as they choose other kernels."""
    monkeypatch.setattr(local, "_TIMED", {})
    trace = _trace(_net())
    asked = []

    def timed(trace, device, *, max_bytes=None, mapped_bytes=None):
        asked.append((device, max_bytes, mapped_bytes))
        return OpTimings(trace.fingerprint(), tuple(1e-3 for _ in trace.ops))

    monkeypatch.setattr(local, "time_ops", timed)
    cuda = torch.device("cuda")
    spec = DEVICES["h100-80gb"]
    first = local.with_local_timings(spec, trace, cuda, 2**30)
    assert asked == [(cuda, 2**30, None)] and first.op_timings is not None
    assert local.with_local_timings(spec, trace, cuda, 2**30).op_timings is first.op_timings
    benchmark = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = not benchmark
        local.with_local_timings(spec, trace, cuda, 2**30)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    assert len(asked) == 2


def test_ctrl_c_while_timing_leaves_no_timing_process(monkeypatch):
    trace = _trace(_net())
    timing._end_waiting()  # none left by earlier tests to take
    started = []
    real = timing._spawn
    monkeypatch.setattr(timing, "_spawn", lambda: started.append(real()) or started[-1])

    class Interrupted(queue.Queue):  # the user presses Ctrl-C while the child times
        def get(self, *args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(timing.queue, "Queue", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        time_ops(trace, CPU)
    assert len(started) == 1 and started[0].poll() is not None  # ended, and reaped
    assert not timing._WAITING


def test_a_timing_process_that_dies_on_an_op_names_it_and_times_the_rest(monkeypatch, caplog):
    """Note [A timing process that dies]: the op it died on keeps the rates, a new process times
    the calls after it."""
    trace = _trace(_net())
    ops = [str(call.op) for call in trace.calls if call is not None and not call.op.is_view]
    victim = ops[len(ops) // 2]
    crashing = (
        "import os, signal\n"
        "from lms.orchestration import timing\n"
        "real = timing._time_call\n"
        "def crash(name, *args):\n"
        f"    if name == {victim!r}:\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    return real(name, *args)\n"
        "timing._time_call = crash\n"
        "timing._main()\n"
    )
    monkeypatch.setattr(timing, "_CHILD", (sys.executable, "-c", crashing))
    with caplog.at_level(logging.WARNING, logger="lms"):
        timings = time_ops(trace, CPU)
    assert f"running {victim}" in caplog.text and "a new process times the calls" in caplog.text
    for taken, call in zip(timings.seconds, trace.calls, strict=True):
        if call is not None and str(call.op) == victim:
            assert taken is None
    others = [
        taken
        for taken, call in zip(timings.seconds, trace.calls, strict=True)
        if call is not None and not call.op.is_view and str(call.op) != victim
    ]
    assert others and all(taken is not None and taken > 0 for taken in others)


def test_a_cpu_steps_ops_are_timed_with_the_allocator_threshold_it_runs_under(monkeypatch):
    """Note [Fresh pages]: under a CPU budget, allocations of a MiB or more fault their pages in
    afresh each time, outputs and a kernel's scratch alike; the timing process is told to map
    them so too, and the times are kept apart by threshold."""
    monkeypatch.setattr(local, "_TIMED", {})
    trace = _trace(_net())
    told = []

    def child(jobs, device, limit_s, mapped_bytes=None):
        told.append(mapped_bytes)
        return {}

    monkeypatch.setattr(timing, "_time_in_child", child)
    resident = DEVICES["cpu"]
    own = dataclasses.replace(resident, page_mapped_bytes=FRESH_PAGES_BYTES)
    for spec in (resident, own, resident):
        local.with_local_timings(spec, trace, CPU)
    assert told == [MAPPED_ALONE_BYTES, FRESH_PAGES_BYTES]


@pytest.mark.skipif(heap._MALLINFO2 is None, reason="counts mapped chunks by mallinfo2")
def test_the_threshold_gives_each_large_allocation_pages_of_its_own():
    script = textwrap.dedent(
        """
        import json, torch
        from lms.runtime.heap import _MALLINFO2, map_alone_from
        torch.empty(2**21).fill_(0)  # 8 MiB freed: glibc raises its threshold past 2 MiB
        before = _MALLINFO2().hblkhd
        x = torch.empty(2**19); kept = _MALLINFO2().hblkhd - before; del x
        map_alone_from(2**20)
        before = _MALLINFO2().hblkhd
        y = torch.empty(2**19); mapped = _MALLINFO2().hblkhd - before; del y
        print(json.dumps({"kept": kept, "mapped": mapped, "freed": _MALLINFO2().hblkhd - before}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kept"] == 0 and result["freed"] == 0, result
    assert 2**21 <= result["mapped"] <= 2**21 + 2 * 4096, result


def test_a_timing_process_started_early_is_taken_and_waits_for_the_next_tune(monkeypatch):
    """Notes [The timing process starts early] and [A timing process waits for the next tune]:
    the block's timing takes the process started at its start, which then waits; the next
    block starts none and its timing takes that one; a tune under another allocator threshold
    starts a process of its own, as does one after they have waited too long; all are ended as
    this process ends."""
    trace = _trace(_net())
    timing._end_waiting()  # none left by earlier tests to take
    spawned = []
    real = timing._spawn
    monkeypatch.setattr(timing, "_spawn", lambda: spawned.append(real()) or spawned[-1])
    with timing.started_early():
        assert time_ops(trace, CPU).timed > 0
    assert len(spawned) == 1 and spawned[0].poll() is None  # waiting for jobs
    assert [worker.process for worker in timing._WAITING] == spawned
    with timing.started_early():
        assert time_ops(trace, CPU).timed > 0
    assert len(spawned) == 1  # the waiting one timed it
    assert time_ops(trace, CPU, mapped_bytes=2**20).timed > 0
    assert len(spawned) == 2 and all(process.poll() is None for process in spawned)
    monkeypatch.setattr(timing, "_TAKEN_WITHIN_S", 0.0)  # both waited too long to be taken
    assert time_ops(trace, CPU).timed > 0
    assert len(spawned) == 3 and spawned[0].poll() is not None and spawned[2].poll() is None
    timing._end_waiting()  # as at exit
    assert all(process.poll() is not None for process in spawned) and not timing._WAITING


def test_a_timing_process_started_early_for_a_tune_that_times_nothing_is_ended(monkeypatch):
    """Note [The timing process starts early]: a tune that loads its plan times nothing, and the
    process it started, still importing PyTorch, would take a core from the steps after it."""
    timing._end_waiting()
    spawned = []
    real = timing._spawn
    monkeypatch.setattr(timing, "_spawn", lambda: spawned.append(real()) or spawned[-1])
    with timing.started_early():
        pass
    assert len(spawned) == 1 and spawned[0].poll() is not None and not timing._WAITING
    with timing.started_early():  # one that timed stays, for the next tune
        assert time_ops(_trace(_net()), CPU).timed > 0
    with timing.started_early():  # and one left waiting is not ended by a block that started none
        pass
    assert len(spawned) == 2 and spawned[1].poll() is None
    assert [worker.process for worker in timing._WAITING] == spawned[1:]
    timing._end_waiting()
