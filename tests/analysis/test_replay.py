"""Step records (`lms.LMS.record_steps`) and their replay (`lms replay`): every committed record
replays within 10% of its measured step time and 3% of its peak; a record holds what the step
did (copies, waits, replays) without changing a bit of it; bad records and misuse are refused."""

import gzip
import json
import pathlib

import pytest
import torch

import lms
from lms.cli import EXIT_BAD_INPUT, main
from lms.core.steprecord import RECORD_FORMAT, load_record
from lms.report.replay import format_replay, replay
from tests.conftest import assert_bitwise, check_schema, recomputing_plan, run_step

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RECORDS = sorted(RESULTS.glob("**/*.json.gz"))


def test_records_are_committed():
    assert any(path.parent.name == "records-cpu" for path in RECORDS), RECORDS


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_record_replays_within_10pct_of_its_step_and_3pct_of_its_peak(path):
    record = load_record(path)
    result = replay(record)
    assert result.matched_ops >= 0.8 * result.trace_ops, result
    assert abs(result.predicted_step_s / result.measured_step_s - 1) <= 0.10, result
    assert abs(result.predicted_peak_bytes / result.measured_peak_bytes - 1) <= 0.03, result
    if record.plan is not None and record.plan.offload:
        assert any(step.copies for step in record.steps)
    assert path.stat().st_size < 16 * 2**20


def _conv_stack():
    torch.manual_seed(0)
    layers = []
    for c in (3, 16, 16, 16, 16, 16):
        layers += [torch.nn.Conv2d(c, 16, 3, padding=1), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers), torch.randn(1, 3, 96, 96)


def _step(model, batch):
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


def _recorded(spill_dir, budget_share=0.6, steps=2):
    """Steps of the conv stack recorded under a plan that spills: tuned on the named CPU spec
    with its copies beside compute, so that how fast this machine is at the time (rates
    measured under a loaded suite) cannot turn it into a plan that only replays."""
    import dataclasses
    from unittest import mock

    from lms.analysis import device_spec, simulate, trace_step
    from lms.orchestration import tuning

    model, x = _conv_stack()
    trace = trace_step(model, [x], _step, device="cpu")
    beside = dataclasses.replace(device_spec("cpu"), copies_take_compute=False)
    peak = simulate(trace, None, beside).peak_bytes
    offload = lms.LMS(budget=int(budget_share * peak), tier="disk", spill_dir=spill_dir)
    with (
        mock.patch.object(tuning, "local_device_spec", lambda device: beside),
        mock.patch.object(tuning, "with_local_timings", lambda spec, *args: spec),
    ):
        offload.tune(model, [x], _step)
    offload.record_steps("cpu")
    for _ in range(steps):
        run_step(model, [x], offload)
    return model, x, offload


def test_record_holds_each_copy_wait_and_op_and_reads_back_equal(spill_dir, tmp_path):
    model, x, offload = _recorded(spill_dir)
    plan = offload.plan
    assert plan is not None and plan.offload
    path = tmp_path / "steps.json.gz"
    offload.save_record(str(path), meta={"case": "test"})
    record = load_record(path)
    assert record.to_dict() == offload.step_record(meta={"case": "test"}).to_dict()
    assert record.trace == offload.step_record().trace
    assert record.meta["case"] == "test" and record.meta["torch"] == torch.__version__
    assert [step.number for step in record.steps] == [1, 2]
    last = record.steps[-1]
    moved = set(plan.offload)
    outs = [c for c in last.copies if c.direction == "out"]
    assert {c.ordinal for c in outs} == moved
    assert all(c.tier == "disk" and c.queued_s <= c.start_s <= c.end_s for c in last.copies)
    assert {c.ordinal for c in last.copies if c.direction == "in"} <= moved
    model_ops = [op for op in last.ops if op.section == "step"]
    assert any(op.backward for op in model_ops) and not model_ops[0].backward
    assert all(op.start_s <= op.end_s <= last.step_s for op in last.ops)
    assert last.peak_bytes >= last.start_bytes
    assert last.stats["offloaded_bytes"] == sum(c.nbytes for c in outs)
    result = replay(record)
    assert result.matched_ops == result.trace_ops
    assert result.measured_copy_s > 0 and result.predicted_copy_s > 0


def test_a_record_keeps_and_replays_the_scratch_its_ops_were_measured_to_take(spill_dir):
    """Note [An op's scratch, measured where it is timed]: the record's spec keeps what the
    timing process measured, and the replay prices the peak with it."""
    import dataclasses

    from lms.core.devices import OpTimings
    from lms.core.steprecord import StepRecord

    _, _, offload = _recorded(spill_dir, steps=1)
    record = offload.step_record()
    trace = record.trace
    scratch = [None] * len(trace.ops)
    scratch[len(trace.ops) - 1] = 256 * 2**20  # the last op: a peak of its own
    seconds = tuple(1e-3 for _ in trace.ops)
    timings = OpTimings(trace.fingerprint(), seconds, scratch=tuple(scratch))
    measured = dataclasses.replace(record, spec=record.spec.with_op_timings(timings))
    again = StepRecord.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert again.spec.op_timings.scratch == tuple(scratch)
    assert replay(again).predicted_peak_bytes > replay(record).predicted_peak_bytes + 200 * 2**20


def test_an_op_that_runs_no_kernel_is_recorded_without_marks_of_its_own(spill_dir):
    """Note [One clock for a step record]: views, `set_` and `empty` (the runtime's own among
    them) take the last op's end as their start and end; a view reads no allocator either."""
    _, _, offload = _recorded(spill_dir)
    ops = offload.step_record().steps[-1].ops
    still = [
        (before, op)
        for before, op in zip(ops, ops[1:], strict=False)
        if op.name.split(".")[1] in ("detach", "view", "set_", "empty", "t")
    ]
    assert {op.section for _, op in still} == {"step", "runtime"}, still
    assert all(op.start_s == op.end_s == before.end_s for before, op in still), still
    views = [(before, op) for before, op in still if op.name.split(".")[1] != "empty"]
    assert all(op.allocated_bytes == before.allocated_bytes for before, op in views)
    kernels = [op for op in ops if op.name.split(".")[1] in ("convolution", "relu")]
    assert kernels and all(op.end_s > op.start_s for op in kernels)


def test_a_record_keeps_the_recorders_own_time_apart_from_the_ops(spill_dir, monkeypatch):
    """Note [One clock for a step record]: the recorder clocks its own work at each op; a read
    of memory in use made 2 ms slower shows in that time, and between the ops, not in their
    spans."""
    import time

    model, x, offload = _recorded(spill_dir, steps=1)
    quick = offload.step_record().steps[-1]
    assert 0 < quick.recorder_s < quick.step_s
    log = offload._log
    assert log is not None
    read = log._memory

    def slow() -> tuple[int, int]:
        time.sleep(2e-3)
        return read()

    monkeypatch.setattr(log, "_memory", slow)
    run_step(model, [x], offload)
    step = offload.step_record().steps[-1]
    reads = sum(1 for op in step.ops if op.end_s > op.start_s or op.name.split(".")[1] == "empty")
    assert step.recorder_s >= step.recorder_reads_s >= reads * 2e-3 > quick.recorder_s
    assert 0 < quick.recorder_reads_s < quick.recorder_s
    result = replay(offload.step_record())
    assert result.measured_recorder_s == step.recorder_s <= result.measured_idle_s
    assert "the recorder's own host time" in format_replay(result)


def test_a_cpu_record_counts_the_storages_its_ops_make_and_free():
    """Note [Memory in use at each op on a CPU]: an op's new outputs count from its end, a
    storage freed between ops comes off, in-place ops and views add nothing; the count at the
    step's end matches glibc's own within a page or two per storage."""
    from torch.testing._internal.two_tensor import TwoTensor

    from lms.runtime.heap import heap_in_use_bytes
    from lms.runtime.steplog import StepLog

    def ops():
        a = torch.randn(2**20)
        b = a * 2
        a.add_(1)
        flat = b.view(-1)
        del a
        c = b + 1
        doubled = torch._foreach_mul([b, c], 2.0)
        sparse = torch.ones(4).to_sparse()  # no storage PyTorch shows: not counted, no error
        pair = TwoTensor(torch.ones(4), torch.ones(4)) * 2  # a wrapper: its parts count
        assert flat.data_ptr() == b.data_ptr() and len(doubled) == 2 and sparse.is_sparse
        assert isinstance(pair, TwoTensor)
        return heap_in_use_bytes(), (b, c, doubled)

    mib4 = 4 * 2**20
    log = StepLog(torch.device("cpu"))
    for number in (1, 2):  # the first step's one-time allocations (the mode's imports) past
        log.begin(number, {})
        heap, alive = ops()
        log.end({})
    step = log.steps[-1]
    made: dict[str, int] = {}  # at each op's first run
    for op in step.ops:
        made.setdefault(op.name, op.allocated_bytes - step.start_bytes)
    assert made["aten.mul.Tensor"] == 2 * mib4
    assert made["aten.add_.Tensor"] == 2 * mib4
    assert made["aten.add.Tensor"] == 2 * mib4  # a went, c came
    assert made["aten._foreach_mul.Scalar"] == 4 * mib4
    assert heap is not None and abs(heap - step.ops[-1].allocated_bytes) < 2**20, alive


def test_recording_changes_no_bit_of_a_recomputing_plan(spill_dir):
    from lms.analysis import trace_step

    model, x = _conv_stack()
    trace = trace_step(model, [x], _step, device="cpu")
    plan = recomputing_plan(trace)
    assert plan.recompute
    reference = run_step(model, [x])
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir)
    offload.record_steps("cpu")
    for _ in range(2):
        assert_bitwise(reference, run_step(model, [x], offload))
    sections = {op.section for op in offload._log.steps[-1].ops}
    assert "replay" in sections, sections


def test_a_record_needs_recorded_steps_and_a_tuned_plan(spill_dir):
    model, x = _conv_stack()
    offload = lms.LMS(budget="1GiB", tier="disk", spill_dir=spill_dir)
    with pytest.raises(lms.LMSError, match="record_steps"):
        offload.step_record()
    offload.record_steps("cpu")
    run_step(model, [x], offload)
    with pytest.raises(lms.LMSError, match="tune"):
        offload.step_record()


def test_a_file_that_is_no_record_is_refused_by_name(tmp_path, capsys):
    bad = tmp_path / "plain.json.gz"
    with gzip.open(bad, "wt") as handle:
        json.dump({"format": "something-else"}, handle)
    with pytest.raises(ValueError, match=RECORD_FORMAT):
        load_record(bad)
    text = tmp_path / "text.txt"
    text.write_text("hello")
    assert main(["replay", str(text)]) == EXIT_BAD_INPUT
    assert "not a readable step record" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.json.gz")]) == EXIT_BAD_INPUT


def test_replay_writes_its_json_and_refuses_a_step_not_recorded(tmp_path, capsys):
    path = RESULTS / "records-cpu" / "unet3d_64_lms.json.gz"
    out = tmp_path / "replay.json"
    assert main(["-q", "replay", str(path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    check_schema("replay", data)
    for key in ("measured_step_s", "predicted_step_s", "measured_peak_bytes"):
        assert data[key] > 0, key
    assert data["predicted_peak_bytes"] > 0 and data["base_step_s"] > 0
    assert "measured" in capsys.readouterr().out
    assert main(["replay", str(path), "--step", "7"]) == EXIT_BAD_INPUT
    assert "step 7 was not recorded" in capsys.readouterr().err


def test_train_records_only_what_it_can_replay(tmp_path, capsys):
    argv = ["train", "--model", "tinylm", "--seq-len", "64", "--steps", "1"]
    assert main([*argv, "--record", str(tmp_path / "r.json.gz")]) == EXIT_BAD_INPUT
    assert "no budget" in capsys.readouterr().err
    assert not (tmp_path / "r.json.gz").exists()


def test_a_record_that_fails_to_save_leaves_no_file(tmp_path, monkeypatch):
    record = load_record(RESULTS / "records-cpu" / "resnet50_224_none.json.gz")
    folder = tmp_path / "out"
    folder.mkdir()

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gzip.GzipFile, "write", full)
    with pytest.raises(OSError, match="No space"):
        record.save(folder / "steps.json.gz")
    assert list(folder.iterdir()) == []


def test_a_step_without_offload_is_priced_under_glibcs_own_threshold(monkeypatch):
    """A step without LMS leaves glibc's mmap threshold as it is, so its record prices it so:
    its ops timed on a warm heap, where a budget's would fault each MiB in afresh (Note [Fresh
    pages])."""
    from lms.core.devices import FRESH_PAGES_BYTES
    from lms.harness.train import _PlainRecord
    from lms.orchestration import local

    monkeypatch.setattr(local, "_TIMED", {})
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    batch = [torch.randn(8, 64)]
    plain = _PlainRecord(model, batch, None, torch.device("cpu"), None)
    assert plain.spec.page_mapped_bytes == FRESH_PAGES_BYTES
    assert plain.spec.op_timings is not None and plain.spec.op_timings.timed > 0


def test_a_replay_names_the_ops_in_which_the_allocator_gave_memory_back():
    """Note [The allocator gives memory back]: on the H200, ResNet50 at 8000 px under 32 GiB
    gave back 6.5 GiB of cached blocks in two convolution backwards that took 27 ms each (priced
    at 2 to 3); without offload at 4000 px, far under the cap, it gave back none."""
    folder = RESULTS / "gpu-NVIDIA-H200" / "truth"
    tight = replay(load_record(folder / "resnet50_8000_lms.json.gz"))
    assert [r.name for r in tight.releases] == ["aten.convolution_backward.default"] * 2
    assert sum(r.released_bytes for r in tight.releases) > 6 * 2**30
    assert all(r.took_s > 0.02 for r in tight.releases)
    assert "The allocator gave back cached memory 2 times" in format_replay(tight)
    assert tight.as_dict()["releases"][0]["released_bytes"] == tight.releases[0].released_bytes
    assert not replay(load_record(folder / "resnet50_4000_none.json.gz")).releases
    cpu = replay(load_record(RESULTS / "records-cpu" / "unet3d_64_lms.json.gz"))
    assert not cpu.releases and "allocator" not in format_replay(cpu)


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_replay_parts_each_committed_step_as_its_plan_prices_it(path):
    """Note [A step's time in parts]: the measured parts add up to the recorded step and the
    priced ones to the plan's own prediction; each kind of op sums its matched ops' kernels."""
    record = load_record(path)
    result = replay(record)
    names = [part.part for part in result.parts]
    assert names[:4] == ["kernels", "replays", "waits", "between ops"], names
    measured = [part.measured_s for part in result.parts if part.measured_s is not None]
    assert all(seconds >= 0 for seconds in measured)
    assert sum(measured) == pytest.approx(result.measured_step_s, rel=1e-9)
    assert sum(p.planned_s for p in result.parts) == pytest.approx(result.planned_step_s, rel=1e-9)
    assert result.measured_idle_s == result.parts[3].measured_s
    gaps = [abs(kind.measured_s - kind.planned_s) for kind in result.op_kinds]
    assert gaps == sorted(gaps, reverse=True) and len(gaps) <= 6
    times = record.steps[-1]
    for kind in result.op_kinds:
        ran = [op for op in times.ops if op.section == "step" and op.name == kind.name]
        ran = [op for op in ran if op.backward == kind.backward]
        assert kind.ops <= len(ran)
        assert kind.measured_s <= sum(op.end_s - op.start_s for op in ran) + 1e-9


def test_a_replay_says_which_part_of_a_cards_step_its_plan_got_wrong(capsys):
    """On the H200, GPT-2 medium's recorded step under LMS ran 0.385 s past its plan, 0.32 s of
    it with the card idle between ops while the host queued them; ResNet50 at 8000 px lost most
    in kernels to the convolution backwards in which the allocator gave memory back."""
    folder = RESULTS / "gpu-NVIDIA-H200" / "truth"
    gpt2 = replay(load_record(folder / "gpt2_1024_lms.json.gz"))
    off = {p.part: p.measured_s - p.planned_s for p in gpt2.parts if p.measured_s is not None}
    assert max(off, key=off.get) == "between ops" and off["between ops"] > 0.3
    resnet = replay(load_record(folder / "resnet50_8000_lms.json.gz"))
    first = resnet.op_kinds[0]
    assert (first.name, first.backward) == ("aten.convolution_backward.default", True)
    assert first.measured_s - first.planned_s > 0.04
    text = format_replay(resnet)
    assert "Where the step's time went" in text and "between ops (s)" in text
    assert "frees of storages" not in text  # a card's caching allocator keeps them
    cpu = format_replay(replay(load_record(RESULTS / "records-cpu" / "unet3d_64_lms.json.gz")))
    assert "frees of storages with pages of their own" in cpu
    assert main(["replay", str(folder / "resnet50_8000_lms.json.gz")]) == 0
    out = capsys.readouterr().out
    assert "aten.convolution_backward.default" in out and "backward" in out
