"""Every script in examples/ runs as a user would run it, and says what it did."""

import pathlib
import subprocess
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
    ],
)
def test_example_runs(script, says, tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert says in done.stdout, done.stdout[-3000:]


def test_every_example_is_run():
    tested = {
        "train_under_a_budget.py",
        "record_and_replay.py",
        "plan_for_another_gpu.py",
        "lightning_fit.py",
        "huggingface_trainer.py",
    }
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested
