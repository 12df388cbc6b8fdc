"""Steps other than one plain forward and backward: a double backward over an input (gradient
penalties), a reentrant checkpoint whose forward runs again inside backward, and gradient
accumulation over micro-batches."""

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.core.recipes import recipes
from lms.planning.candidates import Candidates
from tests.conftest import assert_bitwise, midway_budget


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1)
    )


def _deep():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 256)] + [nn.Linear(256, 256) for _ in range(5)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())], nn.Linear(256, 1))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _run(model, step, inputs, offload=None):
    """``step(model, *inputs)`` under ``offload`` (once, or per call where it is a list of
    micro-batches); returns (loss, grads) as `assert_bitwise` takes them."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if offload is None:
        loss = step(model, *inputs)
    else:
        with offload:
            loss = step(model, *inputs)
    return loss, _grads(model)


def _penalty(model, x):
    """A gradient penalty over the input (as R1 or WGAN-GP take it): a double backward."""
    x = x.clone().requires_grad_()
    out = model(x).sum()
    (grad,) = torch.autograd.grad(out, x, create_graph=True)
    loss = out + grad.square().sum()
    loss.backward()
    return loss.detach()


def _reentrant(model, x):
    x = x.clone().requires_grad_()
    hidden = checkpoint(model[:3], x, use_reentrant=True)
    loss = model[3:](hidden).square().mean()
    loss.backward()
    return loss.detach()


def _micro(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def _accumulate(model, x, parts=3):
    total = torch.zeros(())
    for k in range(parts):
        total += _micro(model, x[k::parts])
    return total


def test_a_double_backward_over_an_input_is_traced_tuned_and_bitwise(tmp_path, caplog):
    # `torch.autograd.grad` over a leaf that a module takes failed under hooks on module inputs.
    model, x = _mlp(), torch.randn(512, 64)
    ref = _run(model, _penalty, (x,))
    trace = trace_step(model, [x], lambda m, b: _penalty(m, *b), device="cpu", min_offload_bytes=0)
    # the double backward saves tensors while backward runs, and reads them in the second one
    saved_in_backward = [
        e for e in trace.events if e.kind == "save" and trace.ops[e.op].phase == "backward"
    ]
    assert saved_in_backward
    offload = lms.LMS(budget="1GiB", tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0)
    plan = offload.tune(model, [x], lambda m, b: _penalty(m, *b))
    assert plan.num_entries == len(trace.entries())
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, _run(model, _penalty, (x,), offload))
    assert "[LMS] step" not in caplog.text
    offload.close()


def test_a_double_backward_below_its_plain_peak_follows_its_plan_bitwise(tmp_path, caplog):
    """Note [What backward makes and saves]: a plan under the plain peak moves what forward
    saved, and the step follows it, though the first backward saves again the copies it read
    back (Note [A storage brought back is its entry's storage])."""
    model, x = _mlp(), torch.randn(2048, 64)
    ref = _run(model, _penalty, (x,))
    trace = trace_step(model, [x], lambda m, b: _penalty(m, *b), device="cpu", min_offload_bytes=0)
    # what the first backward read from forward's saves, it saves again
    start = trace.backward_start_op
    resaved = {e.storage for e in trace.events if e.kind == "save" and e.op >= start}
    assert resaved & {storage for storage, _, op in trace.entries() if op < start}
    plain = simulate(trace, None, device_spec("cpu")).peak_bytes
    offload = lms.LMS(
        budget=int(0.9 * plain), tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0
    )
    plan = offload.tune(model, [x], lambda m, b: _penalty(m, *b))
    assert plan.offload and plan.predicted_peak_bytes <= 0.9 * plain
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, _run(model, _penalty, (x,), offload))
    assert "saves tensors other than" not in caplog.text
    assert offload.stats.diverged_steps == 0 and offload.stats.offloaded_bytes > 0
    offload.close()


def test_a_step_that_saves_again_in_backward_what_forward_saved_replays_nothing():
    """Note [What backward saves again is not replayed]: under a plan that replays, the first
    backward's save of a copy it read back would be a new entry, off the plan."""
    model, x = _mlp(), torch.randn(512, 64)
    penalty = trace_step(model, [x], lambda m, b: _penalty(m, *b), device="cpu")
    assert recipes(penalty) == {}
    once = trace_step(model, [x], lambda m, b: _micro(m, *b), device="cpu")
    assert recipes(once)  # the same model's single backward replays its activations


def test_a_double_backward_under_the_budgets_own_policy_follows_its_record(tmp_path):
    """Without a plan, a copy the first backward read back and saves again is a twin of its
    entry (Note [A storage copied again keeps its place in the plan]): every step saves the
    same entries, and the steps after the first follow its record."""
    model, x = _mlp(), torch.randn(2048, 64)
    ref = _run(model, _penalty, (x,))
    trace = trace_step(model, [x], lambda m, b: _penalty(m, *b), device="cpu", min_offload_bytes=0)
    plain = simulate(trace, None, device_spec("cpu")).peak_bytes
    offload = lms.LMS(
        budget=int(0.6 * plain), tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0
    )
    for _ in range(3):
        assert_bitwise(ref, _run(model, _penalty, (x,), offload))
        # what found each storage's entry lets go of those freed with the step
        assert not offload._by_storage
    assert offload.stats.diverged_steps == 0 and offload.stats.offloaded_bytes > 0
    offload.close()


def test_a_reentrant_checkpoint_names_its_recomputation_and_its_least_budget(tmp_path):
    model, x = _mlp(), torch.randn(2048, 64)
    trace = trace_step(model, [x], lambda m, b: _reentrant(m, *b), device="cpu")
    backward = [op for op in trace.ops if op.phase == "backward"]
    # forward runs again inside backward, in the checkpointed modules, under their names
    again = [op.module for op in backward if op.name == "aten.addmm.default"]
    assert again == ["Sequential.0", "Sequential.2"]
    assert [op.module for op in backward if op.name == "aten.tanh.default"] == ["Sequential.1"]
    # Moving what backward saves and reads at once frees nothing: the least budget named is the
    # step's own peak.
    spec = device_spec("cpu")
    plain = simulate(trace, None, spec).peak_bytes
    checker = Candidates(trace, spec, budget_bytes=plain // 2)
    everything = checker.run(checker.plan(range(checker.num_entries), ahead=1, source="test"))
    assert everything.peak_bytes >= plain
    with pytest.raises(lms.PlanInfeasibleError, match="that the step needs") as caught:
        lms.LMS(budget=plain // 2, tier="disk", spill_dir=str(tmp_path)).tune(
            model, [x], lambda m, b: _reentrant(m, *b)
        )
    assert caught.value.min_budget_bytes == plain


def test_tuning_a_step_that_runs_forward_again_after_backward_is_a_typed_error():
    model, x = _mlp(), torch.randn(1536, 64)
    with pytest.raises(lms.UnplannableStepError, match="once per forward and backward"):
        lms.LMS(budget="64MiB").tune(model, [x], lambda m, b: _accumulate(m, *b))
    with pytest.raises(lms.UnplannableStepError, match="saved in Sequential.0"):
        lms.analyze(model, [x], lambda m, b: _accumulate(m, *b), device_spec="cpu")


def test_accumulation_follows_a_micro_batch_plan_in_blocks_and_warns_in_one(tmp_path, caplog):
    model, x = _deep(), torch.randn(6144, 64)
    ref = _run(model, _accumulate, (x,))
    micro = [x[0::3]]
    trace = trace_step(model, micro, lambda m, b: _micro(m, *b), device="cpu")
    spec = device_spec("cpu")
    budget = midway_budget(trace, spec)
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=str(tmp_path))
    plan = offload.tune(model, micro, lambda m, b: _micro(m, *b))
    assert plan.offload or plan.recompute

    def in_blocks(model, x, parts=3):  # the block around each micro-batch
        total = torch.zeros(())
        for k in range(parts):
            with offload:
                total += _micro(model, x[k::parts])
        return total

    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, _run(model, in_blocks, (x,)))
        assert "[LMS] step" not in caplog.text
        moved = offload.stats.offloaded_tensors + offload.stats.recomputed_tensors
        assert moved == 6 * (len(plan.offload) + len(plan.recompute))
        # one block around all three: the second forward leaves the plan, with a warning that
        # says why, and the step stays exact
        assert_bitwise(ref, _run(model, _accumulate, (x,), offload))
    assert "runs forward again after its backward" in caplog.text
    offload.close()


def _maml(model, xs, ys, xq, yq):
    """Two inner steps on the support set, differentiated through (MAML): each inner gradient
    is taken with create_graph, and the query loss's backward runs through them all."""
    params = dict(model.named_parameters())
    for _ in range(2):
        inner = nn.functional.cross_entropy(functional_call(model, params, (xs,)), ys)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        params = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads, strict=True)}
    loss = nn.functional.cross_entropy(functional_call(model, params, (xq,)), yq)
    loss.backward()
    return loss.detach()


def test_maml_follows_a_plan_under_its_plain_peak_bitwise(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )  # fmt: skip
    batch = (torch.randn(4, 3, 48, 48), torch.randint(0, 5, (4,)))
    batch += (torch.randn(4, 3, 48, 48), torch.randint(0, 5, (4,)))
    ref = _run(model, _maml, batch)
    offload = lms.LMS(budget="70%", tier="disk", spill_dir=str(tmp_path))
    plan = offload.tune(model, list(batch), lambda m, b: _maml(m, *b))
    assert plan.offload or plan.recompute
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, _run(model, _maml, batch, offload))
    assert "saves tensors other than" not in caplog.text
    assert offload.stats.diverged_steps == 0 and offload.stats.offloaded_bytes > 0
    offload.close()
