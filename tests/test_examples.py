"""Every script in examples/ runs as a user would run it, and says what it did."""

import pathlib
import runpy
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ("train_under_a_budget.py", "plan moves"),
        ("record_and_replay.py", "traced ops matched"),
        ("plan_for_another_gpu.py", "Predicted peak with LMS"),
        ("lightning_fit.py", "batches under LMS"),
        ("huggingface_trainer.py", "micro-batches"),
        ("fsdp_llama.py", "offloaded over 3 steps"),
    ],
)
def test_example_runs(script, says, tmp_path, monkeypatch, capfd):
    """As ``python examples/SCRIPT`` runs it: as ``__main__``, from another folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script)])
    monkeypatch.setattr(sys, "path", [str(EXAMPLES), *sys.path])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capfd.readouterr().out  # the spawned processes too
    assert says in out, out[-3000:]


def test_every_example_is_run():
    tested = {
        "train_under_a_budget.py",
        "record_and_replay.py",
        "plan_for_another_gpu.py",
        "lightning_fit.py",
        "huggingface_trainer.py",
        "fsdp_llama.py",
    }
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested
