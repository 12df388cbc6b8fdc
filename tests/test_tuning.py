"""The local device's spec, measured once a process for each GPU and TF32 setting; tuning a
Hugging Face transformers model; the tuned plan's order of backward's reads."""

import contextlib
import dataclasses
import logging
import types

import pytest
import torch

from lms.core.errors import SpillError
from lms.orchestration import local, rates, tuning


def test_local_spec_measures_each_gpu_once_per_tf32_setting(monkeypatch):
    calls = {"link": 0, "compute": 0}

    def link(device):
        calls["link"] += 1
        return 50.0 + calls["link"], 51.0

    def compute(device):
        calls["compute"] += 1
        return rates.ComputeRates(70e12 + calls["compute"], 100e12, 2000.0)

    monkeypatch.setattr(local, "_MEASURED", {})
    monkeypatch.setattr(local, "measure_link_gbps", link)
    monkeypatch.setattr(local, "measure_compute", compute)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(total_memory=80 * 2**30),
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    first = local.local_device_spec(torch.device("cuda"))
    again = local.local_device_spec(torch.device("cuda", 0))
    assert first == again and calls == {"link": 1, "compute": 1}
    assert first.d2h_gbps == 51.0 and first.peak_flops == 70e12 + 1
    # Note [The allocator's slack]: the table's workspace margin and the allocator's idle blocks
    h100 = local.DEVICES["h100-80gb"]
    assert first.workspace_bytes == h100.workspace_bytes + local.ALLOCATOR_SLACK_BYTES
    local.local_device_spec(torch.device("cuda", 1))  # another GPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # other convolution rates
    local.local_device_spec(torch.device("cuda", 0))
    assert calls == {"link": 3, "compute": 3}


def test_local_cpu_spec_measures_once_per_thread_count_and_takes_medians(monkeypatch):
    """Note [A CPU's rates are measured]: the median of three rounds of each rate, the spill
    files' rates as the link, and copies that take compute's cores while its threads fill them."""
    rounds = iter([(150e9, 300e9, 40.0), (90e9, 350e9, 60.0), (200e9, 250e9, 50.0)] * 2)
    calls = {"compute": 0, "spill": 0}

    def compute(device, at_least_s):
        calls["compute"] += 1
        assert device.type == "cpu"
        return rates.ComputeRates(*next(rounds))

    def spill():
        calls["spill"] += 1
        return 4.0, 2.0, 1.5

    monkeypatch.setattr(local, "_MEASURED_CPU", {})
    monkeypatch.setattr(local, "measure_compute", compute)
    monkeypatch.setattr(local, "measure_spill_gbps", spill)
    monkeypatch.setattr(local, "measure_fresh_memory_gbps", lambda: 3.5)
    monkeypatch.setattr(local, "_cores", lambda: 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        spec = local.local_device_spec(torch.device("cpu"))
        assert local.local_device_spec(torch.device("cpu")) == spec
        assert calls == {"compute": 3, "spill": 1}
        assert (spec.peak_flops, spec.peak_flops_half, spec.memory_bandwidth_gbps) == (
            150e9,
            300e9,
            50.0,
        )
        assert (spec.d2h_gbps, spec.h2d_gbps) == (4.0, 2.0) and spec.copies_take_compute
        assert (spec.fresh_memory_gbps, spec.fresh_read_gbps) == (3.5, 1.5)
        assert spec.name == "cpu" and spec.cpu_scratch  # the table's entry, otherwise
        torch.set_num_threads(2)  # a core left for the copies' thread
        fewer = local.local_device_spec(torch.device("cpu"))
        assert calls == {"compute": 6, "spill": 2} and not fewer.copies_take_compute
    finally:
        torch.set_num_threads(threads)


def test_a_temporary_folder_that_refuses_spill_files_leaves_the_tables_link(monkeypatch, caplog):
    measured = rates.ComputeRates(150e9, 300e9, 50.0)

    def full():
        raise SpillError("lms: the spill folder has 0 B free")

    monkeypatch.setattr(local, "_MEASURED_CPU", {})
    monkeypatch.setattr(local, "measure_compute", lambda device, at_least_s: measured)
    monkeypatch.setattr(local, "measure_spill_gbps", full)
    monkeypatch.setattr(local, "measure_fresh_memory_gbps", lambda: None)
    with caplog.at_level("WARNING", logger="lms"):
        spec = local.local_device_spec(torch.device("cpu"))
    table = local.DEVICES["cpu"]
    assert (spec.d2h_gbps, spec.h2d_gbps) == (table.d2h_gbps, table.h2d_gbps)
    assert spec.peak_flops == measured.flops and "0 B free" in caplog.text


def test_spill_rates_are_measured_in_the_spill_folder_and_leave_nothing(tmp_path):
    write, read, fresh_read = rates.measure_spill_gbps(str(tmp_path), files=2, nbytes=1024**2)
    assert write > 0 and read > 0 and (fresh_read is None or fresh_read > 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("model_type", "attention"), [("llama", "sdpa"), ("gpt2", "eager")], ids=["llama", "gpt2"]
)
def test_transformers_model_follows_its_tuned_plan_bitwise(model_type, attention, tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    import lms
    from lms.analysis import device_spec, simulate, trace_step
    from tests.conftest import assert_bitwise, assert_followed

    sizes = {
        "llama": dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "gpt2": dict(n_embd=128, n_layer=2, n_head=4),  # with dropout
    }
    config = transformers.AutoConfig.for_model(model_type, vocab_size=500, **sizes[model_type])
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 500, (2, 128))

    def step(m, batch):
        m(input_ids=batch[0], labels=batch[0]).loss.backward()

    def run(ctx=None):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref = run()
    trace = trace_step(model, [ids], step, device="cpu")
    budget = int(simulate(trace, None, device_spec("cpu")).peak_bytes * 0.8)
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=str(tmp_path))
    plan = offload.tune(model, [ids], step)
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, run(offload))
    assert "saves tensors other than" not in caplog.text
    assert_followed(plan, offload.stats, steps=2)
    offload.close()


def test_the_first_step_prefetches_in_the_order_the_trace_read(spill_dir, monkeypatch):
    # Note [The first step prefetches in the traced order]: with no earlier step to go by, the
    # runtime read newest first, where the simulator prefetches in the trace's order.
    import torchvision

    import lms
    from lms.analysis import device_spec, simulate, trace_step
    from tests.conftest import run_step

    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(num_classes=10), torch.randn(1, 3, 128, 128)

    def step(m, batch):
        m(*batch).float().square().mean().backward()

    trace = trace_step(model, [x], step, device="cpu", min_offload_bytes=0)
    # copies beside compute (a core to spare for them), where moving beats replaying
    beside = dataclasses.replace(device_spec("cpu"), copies_take_compute=False)
    monkeypatch.setattr(tuning, "local_device_spec", lambda device: beside)
    # priced at the spec's rates: the order of reads does not hang on the ops' measured times
    monkeypatch.setattr(tuning, "with_local_timings", lambda spec, *args: spec)
    with pytest.raises(lms.PlanInfeasibleError) as info:
        lms.LMS(budget=1, min_offload_bytes=0).tune(model, [x], step)
    budget = info.value.min_budget_bytes + simulate(trace, None, device_spec("cpu")).peak_bytes
    offload = lms.LMS(budget=budget // 2, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    plan = offload.tune(model, [x], step)
    assert plan.offload and plan.use_order == trace.use_order
    order = list(plan.use_order)
    assert order != sorted(order, reverse=True)  # a residual block's reads are not newest first
    run_step(model, (x,), offload)
    first = offload._step
    assert [entry.ordinal for entry in first.use_queue][: len(order)] == order
    assert first.to_record().use_order == order  # as the step itself read them
    offload.close()


def test_a_budget_given_as_a_share_of_the_peak_is_set_by_tune(spill_dir, tmp_path, caplog):
    """``budget="60%"``, as the command line takes it: tune sets the budget to that share of the
    traced step's simulated peak without offload; a share out of range is refused at once, and
    a block entered before tune is refused before the step runs."""
    import lms
    from lms.analysis import simulate, trace_step
    from lms.orchestration.local import local_device_spec
    from tests.conftest import assert_followed

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)]
    model = torch.nn.Sequential(*layers)
    batch = [torch.randn(4096, 64)]

    def step(model, batch):
        loss = model(batch[0]).square().mean()
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="budget='150%' is not a share of the peak"):
        lms.LMS(budget="150%")
    untuned = lms.LMS(budget="60%", tier="disk", spill_dir=spill_dir)
    with pytest.raises(lms.LMSError, match="call tune"), untuned:
        step(model, batch)
    assert all(p.grad is None for p in model.parameters())  # refused before the step ran
    offload = lms.LMS(budget="60%", tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    with caplog.at_level(logging.INFO, logger="lms"):
        plan = offload.tune(model, batch, step, cache_dir=str(tmp_path))
    said = [r.getMessage() for r in caplog.records if "60% of the step's peak" in r.getMessage()]
    assert said and "kept free" not in said[0]  # a CPU keeps no workspace for libraries
    traced = trace_step(model, batch, step, device="cpu", min_offload_bytes=0)
    peak = simulate(traced, None, local_device_spec(torch.device("cpu"))).peak_bytes
    assert offload.config.budget == plan.budget_bytes == int(0.6 * peak)
    assert offload.config.budget_share is None
    with offload:
        step(model, batch)
    assert_followed(plan, offload.stats, steps=1)  # spilled or replayed, as the rates have it
    offload.close()


def _sequence_model():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)]
    return torch.nn.Sequential(*layers)


def _sequence_step(model, batch):
    loss = model(batch["tokens"]).square().mean()
    loss.backward()
    return loss


def _tokens(length, seed=0):
    return {"tokens": torch.randn(4, length, 64, generator=torch.Generator().manual_seed(seed))}


def test_each_batch_shape_gets_a_plan_of_its_own(spill_dir, tmp_path, monkeypatch):
    """Batches of two sequence lengths: each length is traced and planned once, within the bytes
    the first batch's share set, and each step follows its own length's plan bit for bit; a
    length tuned before takes its plan back without tracing (Note [A plan for each shape of
    batch])."""
    import lms
    import lms.orchestration.session as session
    from tests.conftest import assert_bitwise, run_step

    tuned = []
    real = session.tune_step
    monkeypatch.setattr(session, "tune_step", lambda *a, **k: tuned.append(a[1]) or real(*a, **k))
    model = _sequence_model()
    offload = lms.LMS(budget="70%", tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    plans = {}
    for length in (512, 640, 512, 640):
        batch = _tokens(length, seed=length)
        plan = offload.tune(model, batch, _sequence_step, cache_dir=str(tmp_path))
        assert plan is not None and plan is offload.plan
        assert plans.setdefault(length, plan) is plan  # the same plan for the same length
        assert plan.budget_bytes == offload.config.budget_bytes  # the first share, in bytes
        plain = run_step(model, [batch["tokens"]], loss_fn=lambda out: out.square().mean())
        got = run_step(model, [batch["tokens"]], offload, loss_fn=lambda out: out.square().mean())
        assert_bitwise(plain, got)
    assert [batch["tokens"].shape[1] for batch in tuned] == [512, 640]  # traced once each
    assert plans[512] is not plans[640] and plans[640].fingerprint != plans[512].fingerprint
    # each plan is priced on its own length's tensors: an entry at 640 holds 640/512 of one at 512
    assert [b * 512 for b in plans[640].entry_bytes] == [b * 640 for b in plans[512].entry_bytes]
    assert offload.stats.diverged_steps == 0  # each step followed its own length's plan
    offload.close()


def test_a_later_shape_that_no_plan_fits_follows_the_budgets_policy(spill_dir, tmp_path, caplog):
    """A first batch sets the budget; a much longer one that no plan fits within it is not
    refused mid-run: it warns, and its step follows the budget's own policy, which holds the
    saved tensors within that budget (the bytes the share set at the first tune)."""
    import lms
    from tests.conftest import assert_bitwise, run_step

    model = _sequence_model()
    offload = lms.LMS(budget="60%", tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    first = offload.tune(model, _tokens(256), _sequence_step, cache_dir=str(tmp_path))
    assert first is not None
    longer = _tokens(2048)
    with caplog.at_level("WARNING", logger="lms"):
        assert offload.tune(model, longer, _sequence_step, cache_dir=str(tmp_path)) is None
    assert "steps of this shape follow the budget's own policy" in caplog.text
    assert offload.plan is None
    loss = lambda out: out.square().mean()  # noqa: E731
    plain = run_step(model, [longer["tokens"]], loss_fn=loss)
    assert_bitwise(plain, run_step(model, [longer["tokens"]], offload, loss_fn=loss))
    assert offload.stats.offloaded_tensors > 0
    assert offload.stats.peak_resident_saved_bytes <= first.budget_bytes
    # the first length takes its plan back
    assert offload.tune(model, _tokens(256), _sequence_step, cache_dir=str(tmp_path)) is first
    offload.close()


def test_a_batch_shape_tells_what_its_trace_depends_on():
    """`batch_shape` (Note [A plan for each shape of batch]) tells batches apart where their
    traces differ: lengths, layouts, tensors that share a storage (``labels=input_ids``), flags;
    and not where they hold other values alone."""
    from lms.analysis.trace import batch_shape

    ids, other = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    shared = batch_shape({"input_ids": ids, "labels": ids})
    assert shared == batch_shape({"input_ids": other, "labels": other})  # other values alike
    assert shared != batch_shape({"input_ids": ids, "labels": other})  # a storage of its own
    assert shared != batch_shape({"input_ids": ids[:, :4], "labels": ids[:, :4]})  # shorter
    image = torch.zeros(2, 3, 4, 4)
    channels_last = image.contiguous(memory_format=torch.channels_last)
    assert batch_shape([image]) != batch_shape([channels_last])
    assert batch_shape((image, True)) != batch_shape((image, False))


def test_a_share_is_kept_in_the_bytes_it_came_to_beside_the_buffers_a_library_keeps(
    spill_dir, tmp_path, monkeypatch
):
    """A share of the first batch's peak becomes that many bytes for the batches after it, while
    the plan holds the step's own peak to what they leave beside the buffers its libraries keep
    (Note [Buffers a library keeps]): the next shape is tuned at the share's bytes, not at the
    room the first plan had."""
    import lms
    import lms.orchestration.session as session
    from lms.analysis.simulate import library_kept_bytes

    tuned = []
    real = session.tune_step
    monkeypatch.setattr(
        session, "tune_step", lambda *a, **k: tuned.append(real(*a, **k)) or tuned[-1]
    )
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh()) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), *layers)
    offload = lms.LMS(budget="80%", tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    for rows in (2048, 1536):
        batch = {"tokens": torch.randn(rows, 64)}
        offload.tune(model, batch, _sequence_step, cache_dir=str(tmp_path))
    first, second = tuned
    kept = library_kept_bytes(first.trace, first.spec)
    if not kept:
        pytest.skip("this PyTorch's matrix products keep no buffers")
    assert first.plan.budget_bytes == first.budget - kept  # the room beside the buffers
    assert offload.config.budget_bytes == first.budget == second.budget  # the share, in bytes
    assert second.plan.budget_bytes in (
        second.budget,
        second.budget - library_kept_bytes(second.trace, second.spec),
    )
    offload.close()
