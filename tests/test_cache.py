"""The plan cache: a kept plan is used again only while it still fits the step and the budget;
anything else is tuned again and replaced, and plans are written whole."""

import json
import os

import pytest
import torch

import lms
from lms.analysis.simulate import simulate
from lms.core.plan import Plan
from lms.orchestration import cache, local
from lms.orchestration.tuning import tune_step
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan
from tests.planning.test_planners import Skips


def _step(model, batch):
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


def _tune(folder, budget="18MiB", planner=None):
    torch.manual_seed(0)
    model = Skips()
    offload = lms.LMS(budget=budget, min_offload_bytes=0)
    if planner is None:
        return offload.tune(model, [torch.randn(2048, 256)], _step, cache_dir=str(folder))
    from lms.orchestration.tuning import tune_plan

    return tune_plan(
        model,
        [torch.randn(2048, 256)],
        _step,
        budget_bytes=lms.parse_bytes(budget),
        min_offload_bytes=0,
        cache_dir=str(folder),
        planner=planner,
    )


def _plans(folder):
    """The plans kept in ``folder``, without the op times kept beside them."""
    return sorted(name for name in os.listdir(folder) if not name.endswith(".times.json"))


def _only_file(folder):
    (name,) = _plans(folder)
    return folder / name


def test_a_tuned_plan_is_loaded_the_next_time(tmp_path, caplog):
    caplog.set_level("INFO", logger="lms")
    plan = _tune(tmp_path)
    assert "Loaded the plan" not in caplog.text
    assert _tune(tmp_path) == plan
    assert "Loaded the plan" in caplog.text


def test_a_loaded_plan_is_priced_at_the_op_times_it_was_tuned_at(tmp_path, monkeypatch):
    """Note [A cached plan keeps its op times]: loaded in a new process, which has timed
    nothing, the plan is priced as when it was tuned; times kept for another step are not
    taken."""
    monkeypatch.setattr(local, "_TIMED", {})
    settings = {"budget_bytes": lms.parse_bytes("18MiB"), "min_offload_bytes": 0}
    batch = [torch.randn(2048, 256)]
    torch.manual_seed(0)
    model = Skips()
    tuned = tune_step(model, batch, _step, cache_dir=str(tmp_path), **settings)
    assert tuned.spec.op_timings is not None and tuned.spec.op_timings.timed > 0
    monkeypatch.setattr(local, "_TIMED", {})

    def timed_again(*args, **kwargs):
        raise AssertionError("a loaded plan's ops were timed again")

    monkeypatch.setattr(local, "time_ops", timed_again)
    loaded = tune_step(model, batch, _step, cache_dir=str(tmp_path), **settings)
    assert loaded.plan == tuned.plan
    assert loaded.spec.op_timings.seconds == tuned.spec.op_timings.seconds
    # and the scratch measured with them (Note [An op's scratch, measured where it is timed])
    assert len(tuned.spec.op_timings.scratch) == len(tuned.trace.ops)
    assert loaded.spec.op_timings.scratch == tuned.spec.op_timings.scratch
    assert simulate(loaded.trace, loaded.plan, loaded.spec).step_s == pytest.approx(
        simulate(tuned.trace, tuned.plan, tuned.spec).step_s, rel=1e-9
    )
    (times,) = set(os.listdir(tmp_path)) - set(_plans(tmp_path))
    kept = json.loads((tmp_path / times).read_text())
    (tmp_path / times).write_text(json.dumps({**kept, "fingerprint": "another step"}))
    again = tune_step(model, batch, _step, cache_dir=str(tmp_path), **settings)
    assert again.plan == tuned.plan and again.spec.op_timings is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # cut short
        lambda text: json.dumps({**json.loads(text), "unknown_field": 1}),  # another release's
        lambda text: json.dumps({**json.loads(text), "offload": [], "recompute": []}),  # too big
        lambda text: json.dumps({**json.loads(text), "num_entries": 1, "offload": [0]}),  # other
    ],
    ids=["truncated", "unknown-field", "no-longer-fits", "other-step"],
)
def test_a_cached_plan_that_cannot_be_followed_is_tuned_again(tmp_path, caplog, damage):
    plan = _tune(tmp_path)
    path = _only_file(tmp_path)
    path.write_text(damage(path.read_text()))
    with caplog.at_level("WARNING", logger="lms"):
        again = _tune(tmp_path)
    assert "Tuning again" in caplog.text
    assert again == plan and Plan.load(path) == plan  # the kept file is replaced


def _everything_out(trace, spec, budget_bytes, *, half=False):
    return smallest_plan(Candidates(trace, spec, budget_bytes, half))[0]


def test_plans_for_another_budget_or_planner_are_kept_apart(tmp_path):
    tuned = _tune(tmp_path)
    _tune(tmp_path, budget="20MiB")
    assert _tune(tmp_path, planner=_everything_out).source == "minimum"
    assert len(_plans(tmp_path)) == 3
    assert _tune(tmp_path) == tuned  # not the other planner's


def test_a_plan_kept_by_other_planner_code_is_tuned_again(tmp_path, caplog, monkeypatch):
    code = cache.planner_code()
    assert len(code) == 12 and code == cache.planner_code()
    tuned = _tune(tmp_path)
    monkeypatch.setattr("lms.orchestration.tuning.planner_code", lambda: "other")
    caplog.set_level("INFO", logger="lms")
    assert _tune(tmp_path) == tuned
    assert "Loaded the plan" not in caplog.text  # tuned, and filed apart
    assert len(_plans(tmp_path)) == 2


def test_the_cache_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "env"))
    assert cache.cache_folder() == str(tmp_path / "env")
    assert cache.cache_folder(str(tmp_path / "given")) == str(tmp_path / "given")
    torch.manual_seed(0)
    lms.LMS(budget="18MiB", min_offload_bytes=0).tune(Skips(), [torch.randn(2048, 256)], _step)
    assert len(_plans(tmp_path / "env")) == 1


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    plan = Plan(fingerprint="x", offload=(0,), num_entries=1)

    def fail(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        cache.save_plan(plan, str(tmp_path / "plan.json"))
    assert os.listdir(tmp_path) == []
