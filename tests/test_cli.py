"""The command's contract for scripts: exit codes, logs on stderr, versions, help text."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from lms.analysis import device_spec
from lms.cli import EXIT_CODES, EXIT_NO_PLAN, build_parser, main
from tests.conftest import check_schema


def _lms(*argv, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "lms", *argv], capture_output=True, text=True, timeout=300, **kwargs
    )


def test_json_to_stdout_parses_and_logs_go_to_stderr():
    done = _lms("analyze", "--model", "tinylm", "--image-size", "64", "--json", "/dev/stdout")
    report = json.loads(done.stdout)
    check_schema("analyze", report)
    assert report["lms_version"] and report["torch_version"]
    assert "[LMS]" in done.stderr and "[LMS]" not in done.stdout
    assert done.returncode == 0 and report["fits"]


def test_no_plan_that_fits_is_its_own_exit_code():
    done = _lms("-q", "analyze", "--model", "tinylm", "--image-size", "64", "--gpu-memory", "2GiB")
    assert done.returncode == 3, done.stderr
    assert 3 in EXIT_CODES and "no plan fits" in EXIT_CODES[3]


def test_analyze_takes_a_share_of_the_steps_peak_and_a_sweep_refuses_one(tmp_path):
    """The share is of the step's tensors: the spec's workspace (512 MiB) comes on top, whole,
    else a small step's 60% could lie under the workspace alone."""
    out = tmp_path / "report.json"
    argv = ["-q", "analyze", "--model", "tinylm", "--seq-len", "64", "--gpu-memory", "60%"]
    assert main([*argv, "--json", str(out)]) == EXIT_NO_PLAN  # tinylm: its weights alone
    report = json.loads(out.read_text())
    workspace = device_spec("v100-32gb").workspace_bytes
    tensors = report["peak_bytes"] - workspace
    assert workspace > 0 and tensors > 0
    assert report["gpu_memory_bytes"] == workspace + int(0.6 * tensors)
    sweep = ["-q", "sweep", "--model", "tinylm", "--gpu-memory", "60%", "--step", "64"]
    assert main(sweep) == 2


def test_sweep_and_bench_take_sequence_lengths_for_a_model_of_tokens(monkeypatch, tmp_path):
    """``--seq-len`` is the first length of a sweep (its step too, unless given) and the
    lengths a bench runs; on a model of pixels either is refused before any work."""
    from lms.harness import bench as compare

    out = tmp_path / "sweep.json"
    argv = ["-q", "sweep", "--model", "tinylm", "--gpu-memory", "16GiB", "--seq-len", "32"]
    assert main([*argv, "--max-size", "96", "--json", str(out)]) == 0
    assert [point["size"] for point in json.loads(out.read_text())["points"]] == [32, 64, 96]
    asked = {}
    monkeypatch.setattr(
        compare, "bench", lambda model, **kw: asked.update(kw) or {"largest_size": {}, "points": []}
    )
    assert main(["-q", "bench", "--model", "tinylm", "--seq-len", "32,64"]) == 0
    assert asked["sizes"] == [32, 64]
    for command in (["sweep", "--gpu-memory", "16GiB"], ["bench"]):
        assert main([*command, "--model", "resnet50", "--seq-len", "64"]) == 2
    assert main(["sweep", "--model", "tinylm", "--gpu-memory", "16GiB"]) == 2  # nothing to grow


def test_every_bench_run_failing_is_its_own_exit_code(monkeypatch, tmp_path):
    from lms.harness import bench as compare

    monkeypatch.setattr(compare, "_CHILD", "raise SystemExit('no')\n")
    argv = ["-q", "bench", "--model", "tinylm", "--sizes", "32", "--methods", "none", "--steps"]
    assert main([*argv, "1", "--repeats", "1"]) == 4


def test_version_names_lms_and_torch():
    done = _lms("--version")
    assert done.returncode == 0 and done.stdout.startswith("lms ") and "torch" in done.stdout


def test_quiet_turns_the_progress_bars_off(capfd, monkeypatch):
    argv = ["train", "--model", "tinylm", "--seq-len", "32", "--steps", "1", "--no-lms"]
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert main(argv) == 0
    loud = capfd.readouterr().err
    assert main(["-q", *argv]) == 0  # sets TQDM_DISABLE for the processes it starts
    quiet = capfd.readouterr().err
    monkeypatch.delenv("TQDM_DISABLE")
    assert "step/s" in loud and "step/s" not in quiet


def test_every_option_has_help_and_the_exit_codes_are_in_it():
    parser = build_parser()
    assert all(f"  {code}  " in parser.format_help() for code in EXIT_CODES)
    commands = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    missing = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if action.option_strings and action.help in (None, "") and action.dest != "help"
    ]
    assert not missing, missing


@pytest.mark.parametrize("command", ["analyze", "sweep", "train", "bench", "demo"])
def test_each_command_has_help(command):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0


@pytest.mark.parametrize(
    ("missing", "argv", "extra"),
    [
        ("torchvision", ["analyze", "--model", "resnet50", "--image-size", "64"], "zoo"),
        ("monai", ["sweep", "--model", "unet3d", "--gpu-memory", "1GiB", "--step", "16"], "zoo"),
        (
            "matplotlib",
            ["analyze", "--model", "tinylm", "--image-size", "64", "--plot", "m.png"],
            "plot",
        ),
        ("torchvision", ["demo"], "zoo"),
    ],
)
def test_a_missing_extra_is_named_before_any_work(
    missing, argv, extra, monkeypatch, capsys, tmp_path
):
    import importlib.util

    import lms.orchestration.analyze as analyze

    monkeypatch.chdir(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    ran = []
    monkeypatch.setattr(analyze, "analyze", lambda *a, **k: ran.append(1))
    assert main(argv) == 2 and not ran
    err = capsys.readouterr().err
    assert f"needs {missing}, which is not installed" in err
    assert f"pip install 'large-model-support[{extra}]'" in err


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_language_models_of_the_zoo_are_analyzed_at_a_sequence_length(model, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "report.json"
    argv = ["-q", "analyze", "--model", model, "--seq-len", "128", "--device-spec", "h100"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["input_shapes"][0] == [1, 128]


def test_the_command_imports_a_builder_from_the_folder_it_runs_in(tmp_path):
    """The console script, unlike ``python -m``, does not put that folder on the path itself."""
    script = shutil.which("lms", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the lms command is not installed beside this Python")
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\n\ndef net():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 2, 1))\n"
    )
    argv = [
        "-q",
        "analyze",
        "--model",
        "mymodels:net",
        "--image-size",
        "8",
        "--json",
        "/dev/stdout",
    ]
    done = subprocess.run(
        [script, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["input_shapes"] == [[1, 3, 8, 8], [1, 6, 6]]


@pytest.mark.parametrize(("flag", "resident"), [([], True), (["--no-cpu-resident"], False)])
def test_train_keeps_glibcs_own_heap_where_asked(flag, resident, monkeypatch):
    """`--no-cpu-resident` trains under glibc's own mmap threshold (`LMSConfig.cpu_resident`);
    by default the resident set holds the budget too."""
    import lms.harness.train as harness

    asked = {}

    def train(model, **kwargs):
        asked.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "train", train)
    with pytest.raises(SystemExit):
        main(["train", "--model", "tinylm", "--budget", "1GiB", *flag])
    assert asked["cpu_resident"] is resident
