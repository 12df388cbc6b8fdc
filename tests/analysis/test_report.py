"""Reports: simulator invariants, [LMS] lines, the PNG, the memory_viz snapshot, the CLI."""

import bisect
import dataclasses
import json
import pickle
import pickletools
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from lms.analysis import device_spec, runtime_plan, simulate, trace_step
from lms.cli import main
from lms.core.plan import Plan
from lms.orchestration.analyze import analyze


def deep():
    layers = [torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU()]
    for _ in range(7):
        layers += [torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


# Opcodes of plain dicts, lists, strings and numbers: what the viewer's own unpickler reads.
VIEWER_OPCODES = {
    "PROTO",
    "FRAME",
    "STOP",
    "MARK",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "SETITEM",
    "SETITEMS",
    "APPEND",
    "APPENDS",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "BINFLOAT",
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
    "MEMOIZE",
    "BINPUT",
    "LONG_BINPUT",
    "BINGET",
    "LONG_BINGET",
}


@pytest.fixture(scope="module")
def report():
    return analyze(
        deep,
        lambda: [torch.randn(8, 3, 128, 128)],
        gpu_memory="570MiB",
        device_spec="v100-16gb",
        name="net",
    )


def test_offloading_everything_lowers_the_peak(report):
    trace = report.trace
    spec = device_spec("v100-32gb")
    n = len(trace.entries())
    plain = simulate(trace, None, spec)
    everything = simulate(
        trace, Plan(fingerprint="x", offload=tuple(range(n)), num_entries=n), spec
    )
    assert everything.peak_tensor_bytes < plain.peak_tensor_bytes
    assert everything.offloaded_bytes == sum(size for _, size, _ in trace.entries())
    assert everything.step_s >= plain.step_s
    assert plain.overhead == 0.0
    # host memory holds what was offloaded, and nothing is left at the end
    assert everything.host_peak_bytes > 0 and everything.host_bytes[-1] == 0
    assert plain.device_bytes[-1] >= 0


def _wide_trace(activation, *after):
    """A CPU step whose activation of 8192 x 1040 floats takes 32.5 MiB: ``Linear(64, 1040)``,
    ``activation``, ``Linear(1040, 8)``, then ``after``."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1040), activation, torch.nn.Linear(1040, 8), *after
    )
    return trace_step(model, [torch.randn(8192, 64)], device="cpu")


def _held(nbytes, spec):
    """What a storage of ``nbytes`` holds: the allocator's rounding, or on the CPU a storage of
    32 MiB or more its own pages and one more (Note [A mapped storage's own page])."""
    if spec.page_mapped_bytes is not None and nbytes >= spec.page_mapped_bytes:
        return (nbytes // 4096 + 1) * 4096
    return -(-nbytes // spec.alloc_round_bytes) * spec.alloc_round_bytes


@pytest.mark.parametrize("spec_name", ["v100-32gb", "cpu"])
def test_the_intervals_add_up_to_the_device_bytes_the_sweep_counted(report, spec_name):
    # The intervals are made only when a report asks; the sweep counts from columns.
    trace, spec = report.trace, device_spec(spec_name)
    n = len(trace.entries())
    every_other = Plan(fingerprint="x", offload=tuple(range(0, n, 2)), num_entries=n)
    for plan in (None, every_other, report.plan):
        result = simulate(trace, plan, spec)
        moved = {i.storage for i in result.intervals if i.kind == "reloaded"}
        assert plan is None or moved  # offloaded storages come back
        if spec_name == "cpu":
            assert any(i.kind == "scratch" for i in result.intervals)
        for time_s, device in zip(result.timeline_s, result.device_bytes, strict=True):
            live = [i for i in result.intervals if i.start_s <= time_s < i.end_s]
            assert sum(_held(i.nbytes, spec) for i in live) == device
    # Without a plan, a storage allocated by op a and freed after op f is there while a..f run.
    plain = simulate(trace, None, spec)
    scratch = {op.index: op.cpu_scratch_bytes for op in trace.ops} if spec.cpu_scratch else {}
    starts = plain.residency.clock.start
    last_backward = max(op.index for op in trace.ops if op.phase == "backward")
    for op in trace.ops:
        at = bisect.bisect_right(plain.timeline_s, starts[op.index]) - 1
        alive = [
            record.nbytes
            for record in trace.storages
            if record.alloc_op <= op.index
            and (record.free_op is None or record.free_op >= op.index)
        ]
        alive.append(scratch.get(op.index, 0))
        expected = sum(_held(n, spec) for n in alive)
        if op.index <= last_backward:  # Note [The autograd graph on a CPU's heap]
            recorded = sum(o.phase == "forward" for o in trace.ops[: op.index + 1])
            expected += spec.graph_bytes_per_op * recorded
        assert plain.device_bytes[at] == expected, op.index


def test_storages_glibc_maps_hold_their_pages_and_a_header_page():
    """Note [A mapped storage's own page]: on the CPU spec a storage the allocator maps alone
    (here of 32 MiB or more, glibc's own threshold) counts its pages and one more; smaller ones
    and a GPU's blocks the allocator's rounding."""
    from lms.core.devices import FRESH_PAGES_BYTES, MAPPED_ALONE_BYTES

    trace = _wide_trace(torch.nn.Tanh())
    assert device_spec("cpu").page_mapped_bytes == MAPPED_ALONE_BYTES  # a budget's threshold
    cpu = dataclasses.replace(
        device_spec("cpu"), page_mapped_bytes=FRESH_PAGES_BYTES, fresh_memory_gbps=None
    )  # the same op times with and without the pages: Note [Fresh pages] prices them
    rounded = dataclasses.replace(cpu, page_mapped_bytes=None)
    mapped, plain = simulate(trace, None, cpu), simulate(trace, None, rounded)
    assert mapped.timeline_s == plain.timeline_s
    for time_s, got, was in zip(
        mapped.timeline_s, mapped.device_bytes, plain.device_bytes, strict=True
    ):
        live = [i for i in mapped.intervals if i.start_s <= time_s < i.end_s]
        assert got == sum(_held(i.nbytes, cpu) for i in live)
        big = [i.nbytes for i in live if i.nbytes >= 32 * 1024**2]
        assert got - was == sum(_held(n, cpu) - _held(n, rounded) for n in big)
    assert (
        mapped.peak_bytes > plain.peak_bytes and mapped.peak_tensor_bytes == plain.peak_tensor_bytes
    )


def test_the_cpu_spec_counts_the_autograd_graph_beside_the_tensors():
    """Note [The autograd graph on a CPU's heap]: each forward op's share, from the op to the end
    of backward, in the device bytes and not in the tensors' peak; the snapshot names it."""
    from lms.report.memviz import snapshot_dict

    trace = _wide_trace(torch.nn.Tanh())
    cpu = device_spec("cpu")
    counted, blind = (
        simulate(trace, None, cpu),
        simulate(trace, None, dataclasses.replace(cpu, graph_bytes_per_op=0)),
    )
    forward = [op.index for op in trace.ops if op.phase == "forward"]
    graph = [i for i in counted.intervals if i.kind == "graph"]
    assert len(graph) == len(forward) and {i.nbytes for i in graph} == {cpu.graph_bytes_per_op}
    assert counted.peak_tensor_bytes == blind.peak_tensor_bytes
    # the peak is after forward: every op's share is there
    assert counted.peak_bytes - blind.peak_bytes == cpu.graph_bytes_per_op * len(forward)
    last = max(op.index for op in trace.ops if op.phase == "backward")
    assert {i.end_s for i in graph} == {counted.residency.clock.done_at[last]}
    events = snapshot_dict(trace, counted)["device_traces"][0]
    named = [e for e in events if e["category"] == "autograd_detail" and e["action"] == "alloc"]
    assert len(named) == len(forward)
    assert {e["frames"][0]["name"] for e in named} == {"the autograd graph"}


def test_slower_link_costs_more_time(report):
    trace = report.trace
    n = len(trace.entries())
    plan = Plan(fingerprint="x", offload=tuple(range(n)), num_entries=n)
    fast = simulate(trace, plan, device_spec("gh200"))
    slow = simulate(trace, plan, device_spec("v100-32gb-pcie3"))
    assert slow.overhead > fast.overhead


def test_the_report_prices_its_plan_again_on_a_slower_link(report):
    # Note [A plan's margin on the link]: the same plan, its copies at 80% of the rates
    slow, planned = report.slow_link, report.planned
    assert report.plan.offload and slow is not None
    assert slow.offloaded_bytes == planned.offloaded_bytes  # the same plan
    assert slow.step_s >= planned.step_s and slow.base_step_s == planned.base_step_s
    assert f"{slow.overhead:+.1%}" in report.lines()[-1]
    assert report.as_dict()["predicted_overhead_slow_link"] == slow.overhead
    roomy = analyze(deep, lambda: [torch.randn(1, 3, 32, 32)], device_spec="v100-16gb")
    assert roomy.slow_link is None and "80%" not in "\n".join(roomy.lines())


def test_measured_compute_prices_ops_and_hides_copies(report):
    # What a convolution and an add reach here, and what that does to the prediction.
    from lms.orchestration.rates import measure_compute

    with torch.autocast("cpu", dtype=torch.bfloat16):  # measured in fp32 all the same
        rates = measure_compute(torch.device("cpu"), at_least_s=0.01)
    assert 1e8 < rates.flops < 1e13 and 1e7 < rates.flops_half < 1e13
    assert 0.1 < rates.bandwidth_gbps < 1000
    trace = report.trace
    n = len(trace.entries())
    plan = Plan(fingerprint="x", offload=tuple(range(n)), num_entries=n)
    peak = device_spec("v100-32gb")
    measured = dataclasses.replace(
        peak,
        peak_flops=peak.peak_flops / 10,
        peak_flops_half=peak.peak_flops_half / 10,
        memory_bandwidth_gbps=peak.memory_bandwidth_gbps / 10,
    )
    fast, slow = simulate(trace, plan, peak), simulate(trace, plan, measured)
    assert slow.base_step_s > 5 * fast.base_step_s
    assert slow.overhead < fast.overhead  # the same copies hide behind longer compute
    local = analyze(deep, lambda: [torch.randn(1, 3, 32, 32)], device_spec="local")
    assert local.spec.name == "cpu"
    # Note [Ops timed on the device]: the local CPU prices this step's ops at their own times
    timings = local.spec.op_timings
    assert timings is not None and timings.timed > 0
    assert timings.fingerprint == local.trace.fingerprint()
    named = analyze(deep, lambda: [torch.randn(1, 3, 32, 32)], device_spec="v100-32gb")
    assert named.spec.op_timings is None


def test_ops_that_make_storages_the_allocator_maps_anew_pay_their_first_writes():
    """Note [Fresh pages]: each op pays bytes over the fresh-memory rate for the
    storages the allocator maps alone that it makes (here of at least 32 MiB), nothing for
    smaller ones; a GPU spec, nothing."""
    from lms.analysis.simulate import op_seconds
    from lms.core.devices import FRESH_PAGES_BYTES

    trace = _wide_trace(torch.nn.ReLU())
    cpu = dataclasses.replace(device_spec("cpu"), page_mapped_bytes=FRESH_PAGES_BYTES)
    free = dataclasses.replace(cpu, fresh_memory_gbps=None)
    charged, uncharged = op_seconds(trace, cpu, False), op_seconds(trace, free, False)
    paid = [a - b for a, b in zip(charged, uncharged, strict=True)]
    expected = [0.0] * len(trace.ops)
    for storage in trace.storages:
        if storage.alloc_op >= 0 and storage.nbytes >= FRESH_PAGES_BYTES:
            expected[storage.alloc_op] += storage.nbytes / (cpu.fresh_memory_gbps * 1e9)
    assert sum(x > 0 for x in expected) >= 2  # the activation and its gradient at least
    assert paid == pytest.approx(expected, abs=1e-12)
    assert simulate(trace, None, cpu).base_step_s == pytest.approx(
        simulate(trace, None, free).base_step_s + sum(expected)
    )
    assert device_spec("h100").fresh_memory_gbps is None


def test_reads_back_into_fresh_pages_pay_their_faults():
    """Note [Fresh pages]: a storage the allocator maps alone (here of at least 32 MiB) read
    back from its spill file costs the read and its first writes; a smaller one the read
    alone."""
    from lms.core.devices import FRESH_PAGES_BYTES

    trace = _wide_trace(torch.nn.Tanh(), torch.nn.Tanh())
    entries = trace.entries()
    n = len(entries)
    # synchronous copies, no core lost to them: each read back adds its own time to the step
    plan = Plan(fingerprint="x", offload=tuple(range(n)), num_entries=n, sync_mode=3)
    cpu = dataclasses.replace(
        device_spec("cpu"), copies_take_compute=False, page_mapped_bytes=FRESH_PAGES_BYTES
    )
    faulting = dataclasses.replace(cpu, fresh_read_gbps=0.5)
    extra = sum(size / 0.5e9 for _, size, _ in entries if size >= FRESH_PAGES_BYTES)
    assert extra > 0 and any(size < FRESH_PAGES_BYTES for _, size, _ in entries)
    assert simulate(trace, plan, faulting).step_s == pytest.approx(
        simulate(trace, plan, cpu).step_s + extra
    )
    assert (
        device_spec("cpu").fresh_read_gbps is None and device_spec("h100").fresh_read_gbps is None
    )


def test_lines_say_what_tflms_said(report):
    text = "\n".join(report.lines())
    assert "[LMS] The model has" in text and "learning parameters" in text
    assert "The largest operation is" in text
    assert "LMS is needed" in text
    assert "Predicted peak with LMS" in text


def test_lines_say_what_stays_for_the_code_and_what_convolutions_take_on_a_cpu():
    # This step keeps the model's output in a variable while backward runs, and the last Tanh
    # saved it: no plan moves it. Contiguous convolutions take oneDNN's copies on a CPU.
    def holding(model, batch):
        out = model(*batch)
        loss = out.mean()
        loss.backward()
        return loss, out

    def report_on(spec, memory, step_fn=holding):
        batch = [torch.randn(8, 3, 128, 128)]
        return analyze(deep, lambda: batch, step_fn, gpu_memory=memory, device_spec=spec)

    # The default step lets go of the output before backward: nothing stays for its code.
    assert "stay on the device" not in "\n".join(report_on("cpu", "70MiB", None).lines())

    cpu = report_on("cpu", "70MiB")
    text = "\n".join(cpu.lines())
    assert "1 saved storages (8.00 MiB) stay on the device: the step's code holds them" in text
    assert "Convolutions take up to" in text and "aten.convolution_backward.default" in text
    entries = [storage for storage, _, _ in cpu.trace.entries()]
    held = [entries.index(storage) for storage in cpu.trace.held_by_code]
    assert cpu.plan is not None and cpu.plan.source != "infeasible" and cpu.plan.offload
    assert held and not set(held) & set(cpu.plan.offload + cpu.plan.recompute)
    for plan in (report_on("cpu", "10MiB").plan, report_on("v100-16gb", "70MiB").plan):
        assert plan is not None and not set(held) & set(plan.offload)  # nor when nothing fits
    assert "Convolutions take up to" not in "\n".join(report_on("v100-16gb", "70MiB").lines())
    freeing = analyze(
        deep,
        lambda: [torch.randn(8, 3, 128, 128)],
        holding,
        gpu_memory="70MiB",
        device_spec="cpu",
        free_held=True,
    )
    text = "\n".join(freeing.lines())
    assert "stay on the device" not in text
    assert "holds 1 saved storages (8.00 MiB) into backward" in text and "(free_held)" in text


def test_the_analysis_is_logged_before_the_planner_speaks(caplog):
    with caplog.at_level("INFO", logger="lms"):
        analyze(deep, lambda: [torch.randn(8, 3, 128, 128)], gpu_memory="570MiB", name="net")
    logged = [record.getMessage() for record in caplog.records]
    order = [
        next(i for i, line in enumerate(logged) if marker in line)
        for marker in ("Analyzing net", "LMS is needed", "[Planner]", "Predicted peak with LMS")
    ]
    assert order == sorted(order), logged


def test_plot_writes_a_png_of_the_simulated_memory(report, tmp_path):
    path = tmp_path / "memory.png"
    figure = report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top = figure.axes[0]
    plain, planned, budget = top.get_lines()
    gib = 1024**3
    # the curves count what the legend and the budget count: tensors and the workspace margin
    assert max(plain.get_ydata()) * gib == pytest.approx(report.plain.peak_bytes)
    assert max(planned.get_ydata()) * gib == pytest.approx(report.planned.peak_bytes)
    assert f"peak {report.plain.peak_bytes / gib:.2f} GiB" in plain.get_label()
    assert list(plain.get_xdata()) == pytest.approx([t * 1e3 for t in report.plain.timeline_s])
    assert budget.get_ydata()[0] * gib == pytest.approx(report.budget_bytes)


def test_plots_leave_pyplot_and_the_backend_alone(tmp_path):
    """Every plot draws on a figure of its own: no pyplot state, no backend switched."""
    script = textwrap.dedent(
        f"""
        import matplotlib, sys, torch
        from lms import analyze
        from lms.harness.sweep import plot_sweep
        matplotlib.use("pdf")  # a user's choice, which the plots must keep
        backend = lambda: dict.__getitem__(matplotlib.rcParams, "backend")  # without resolving
        report = analyze(lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()),
                         lambda: [torch.randn(512, 64)], gpu_memory="1GiB")
        report.plot({str(tmp_path / "a.png")!r})
        point = dict(size=8, fits_without_lms=True, rate_without_lms=1e6, fits_with_lms=True,
                     rate_with_lms=1e6)
        plot_sweep(dict(unit="pixels", points=[point], model="m", batch_size=1,
                        gpu_memory_bytes=2**30, device_spec=dict(name="cpu", link="disk")),
                   {str(tmp_path / "b.png")!r})
        assert "matplotlib.pyplot" not in sys.modules, "pyplot imported"
        assert backend() == "pdf", backend()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_snapshot_is_what_memory_viz_reads(report, tmp_path):
    path = tmp_path / "snap.pickle"
    report.save_snapshot(path)
    raw = path.read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert ops <= VIEWER_OPCODES, ops - VIEWER_OPCODES
    assert raw[1] <= 4  # protocol
    data = pickle.loads(raw)
    assert set(data) == {"segments", "device_traces"}
    events = data["device_traces"][0]
    assert {e["action"] for e in events} == {"alloc", "free_requested", "free_completed"}
    assert "unknown" in {e["category"] for e in events}
    for key in ("addr", "size", "stream", "time_us", "frames", "category"):
        assert all(key in e for e in events)
    times = [e["time_us"] for e in events]
    assert times == sorted(times)
    live = {}
    for e in events:
        if e["action"] == "alloc":
            assert e["addr"] not in live
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
    # Note [A snapshot the viewer can replay]: what outlives the step is the segment's blocks
    (segment,) = data["segments"]
    active = {b["address"]: b["size"] for b in segment["blocks"] if b["state"] != "inactive"}
    assert active == live and active
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    peak_tensors = report.planned.peak_bytes - report.spec.workspace_bytes
    assert peak_tensors <= segment["total_size"] <= 1.5 * peak_tensors
    import torch.cuda._memory_viz as viewer

    assert "segments: 1" in viewer.segsum(data)
    assert "Allocator State History" in viewer.segment_plot(data)
    assert "Active Memory Timeline" in viewer.trace_plot(data)
    # frames name the op that made each storage and the module running it
    made = [e for e in events if e["action"] == "alloc" and "aten." in e["frames"][0]["name"]]
    modules = {op.module for op in report.trace.ops}
    assert made and all(e["frames"][0]["filename"] in modules for e in made), made[:3]
    assert any(e["frames"][0]["filename"].startswith("Sequential.") for e in made)
    json_path = tmp_path / "snap.json"
    report.save_snapshot(json_path)
    assert json.loads(json_path.read_text())["device_traces"][0][0]["action"] == "alloc"


def test_the_reported_plan_prefetches_its_first_step_in_the_traced_order(report):
    """A plan taken from a report and handed to `LMS(plan=...)` carries the order backward
    read the saved storages in the trace, as a tuned plan does."""
    plan = report.plan
    assert plan is not None and plan.offload
    assert plan.use_order == report.trace.use_order
    assert sorted(plan.use_order) == sorted(set(plan.use_order)) and len(plan.use_order) > 1
    assert Plan.from_json(plan.to_json()).use_order == plan.use_order


def test_runtime_plan_respects_the_budget_when_it_can():
    trace = trace_step(deep, lambda: [torch.randn(8, 3, 128, 128)], device="cpu")
    spec = device_spec("cpu")
    plain = simulate(trace, None, spec)
    plan = runtime_plan(trace, int(plain.peak_tensor_bytes * 0.8))
    planned = simulate(trace, plan, spec)
    assert plan.offload
    assert planned.peak_tensor_bytes < plain.peak_tensor_bytes


def test_cli_analyze_writes_json_plot_and_snapshot(tmp_path, caplog):
    caplog.set_level("INFO", logger="lms")
    out = tmp_path / "r.json"
    code = main(
        [
            "analyze",
            "--model",
            "resnet50",
            "--image-size",
            "1024",
            "--batch-size",
            "1",
            "--gpu-memory",
            "1GiB",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
            "--snapshot",
            str(tmp_path / "s.pickle"),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    for key in (
        "peak_bytes",
        "lms_peak_bytes",
        "fits",
        "num_ops",
        "param_bytes",
        "largest_op",
        "tune_seconds",
        "offloaded_bytes",
        "predicted_overhead",
    ):
        assert key in data
    assert data["peak_bytes"] > 2**30 and data["lms_peak_bytes"] < data["peak_bytes"]
    assert data["largest_op"]["bytes"] > 0
    assert (tmp_path / "p.png").exists() and (tmp_path / "s.pickle").exists()
    assert "[LMS] The largest operation is" in caplog.text


def test_cli_rejects_a_bad_size(capsys):
    code = main(["analyze", "--model", "resnet50", "--image-size", "64", "--gpu-memory", "lots"])
    assert code == 2
    assert "--gpu-memory" in capsys.readouterr().err


@pytest.mark.parametrize("memory", [0, "0GiB"])
def test_analyze_refuses_no_device_memory_before_tracing(memory):
    def build():
        raise AssertionError("built although the memory was refused")

    with pytest.raises(ValueError, match="gpu_memory=.* must be more than 0 bytes"):
        analyze(build, [torch.randn(1, 3, 8, 8)], gpu_memory=memory)


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["analyze", "--model", "vgg99", "--image-size", "64"]) == 2
    assert "not in the zoo" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not in the zoo"):
        from lms.harness.zoo import zoo_model

        zoo_model("vgg99")


def test_the_html_report_holds_the_lines_the_memory_the_copies_and_the_plan(report, tmp_path):
    """Note [A report that works offline]: one page, nothing fetched, whose graphs and table
    carry the report's own numbers."""
    import html.parser

    path = tmp_path / "report.html"
    report.save_html(path)
    page = path.read_text()
    assert "http://" not in page and "https://" not in page and "src=" not in page

    class Read(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.rows, self.row, self.cell, self.pre = [], [], None, None, ""
            self.in_pre = False

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            self.tags.append((tag, attrs))
            if tag == "tr" and attrs.get("class"):
                self.row = []
            elif tag == "td" and self.row is not None:
                self.cell = ""
            self.in_pre = self.in_pre or tag == "pre"

        def handle_endtag(self, tag):
            if tag == "td" and self.row is not None:
                self.row.append(self.cell)
                self.cell = None
            elif tag == "tr" and self.row is not None:
                self.rows.append(self.row)
                self.row = None
            elif tag == "pre":
                self.in_pre = False

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data
            if self.in_pre:
                self.pre += data

    read = Read()
    read.feed(page)
    assert read.pre.splitlines() == report.lines()
    memory = {a["data-name"]: int(a["data-peak"]) for t, a in read.tags if t == "polyline"}
    assert memory == {
        "without LMS": report.plain.peak_bytes,
        "with LMS": report.planned.peak_bytes,
    }
    (budget,) = [int(a["data-bytes"]) for t, a in read.tags if t == "line"]
    assert budget == report.budget_bytes
    plan = report.plan
    entries = report.trace.entries()
    assert len(read.rows) == len(entries)
    chosen = {int(row[0]): row[-1] for row in read.rows}
    assert {i for i, c in chosen.items() if c.startswith("offload")} == set(plan.offload)
    assert {i for i, c in chosen.items() if c == "recompute"} == set(plan.recompute)
    copies = [a for t, a in read.tags if t == "rect" and a.get("class") == "copy"]
    outs = {int(a["data-ordinal"]) for a in copies if a["data-direction"] == "out"}
    assert outs == set(plan.offload) - set(plan.recompute)
    assert any(t == "script" for t, _ in read.tags)  # the zoom


def _chromium():
    """A headless Chromium driven through ChromeDriver, or a skip naming what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("needs Chromium and ChromeDriver (Debian: chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--no-first-run",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


def test_the_html_report_draws_and_zooms_in_a_browser(report, tmp_path):
    """Note [A report that works offline], in a real browser with no network: the page draws
    both graphs and the table, its script raises nothing, the mouse wheel narrows a graph's time
    axis about the pointer and a double click restores it."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.by import By

    path = tmp_path / "report.html"
    report.save_html(path)
    browser = _chromium()
    try:
        browser.get(path.as_uri())
        svg = browser.find_element(By.ID, "memory")
        full = [float(v) for v in svg.get_dom_attribute("viewBox").split()]
        assert svg.size["width"] > 500 and svg.size["height"] > 100
        drawn = browser.execute_script(
            "return [...document.querySelectorAll('polyline.memory')]"
            ".map(line => line.getBBox().width)"
        )
        assert len(drawn) == 2 and min(drawn) > 0.9 * full[2]  # across the whole step
        rows = browser.find_elements(By.CSS_SELECTOR, "#plan tbody tr")
        assert len(rows) == len(report.trace.entries()) and rows[0].is_displayed()
        assert browser.find_elements(By.CSS_SELECTOR, "#copies rect.copy")
        ActionChains(browser).scroll_from_origin(ScrollOrigin.from_element(svg), 0, -300).perform()
        zoomed = [float(v) for v in svg.get_dom_attribute("viewBox").split()]
        assert zoomed[2] < full[2] and full[0] <= zoomed[0] <= full[0] + full[2] - zoomed[2]
        ActionChains(browser).double_click(svg).perform()
        assert [float(v) for v in svg.get_dom_attribute("viewBox").split()] == full
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        browser.save_screenshot(str(tmp_path / "report.png"))
    finally:
        browser.quit()
