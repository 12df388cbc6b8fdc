"""Bad input is refused before any work starts, with an error that names the input and the fix."""

import logging
import os

import pytest
import torch

import lms
from lms.cli import main
from lms.core.plan import Plan


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--json", "missing-folder/out.json", "does not exist"),
        ("--plot", ".", "is a folder"),
        ("--snapshot", "missing-folder/s.pickle", "does not exist"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_analysis(
    option, value, words, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    import lms.orchestration.analyze as analyze

    ran = []
    monkeypatch.setattr(analyze, "analyze", lambda *a, **k: ran.append(1))
    rc = main(["analyze", "--model", "tinylm", "--image-size", "64", option, value])
    assert rc == 2 and not ran
    assert words in capsys.readouterr().err


def test_a_sequence_length_for_a_model_of_images_is_refused_before_the_analysis(
    monkeypatch, capsys
):
    import lms.orchestration.analyze as analyze

    ran = []
    monkeypatch.setattr(analyze, "analyze", lambda *a, **k: ran.append(1))
    assert main(["analyze", "--model", "resnet50", "--seq-len", "64"]) == 2 and not ran
    assert "resnet50 takes pixels; give its edge with --image-size" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_output_in_a_folder_without_write_permission_is_refused(tmp_path, capsys):
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    rc = main(["analyze", "--model", "tinylm", "--image-size", "64", "--json", f"{folder}/t.json"])
    assert rc == 2 and "cannot be written" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["budget", "host_budget"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_size_that_is_not_finite_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"lms: {field}=.* is not a size"):
        lms.LMS(**{field: value})


def test_an_empty_spill_dir_is_refused():
    with pytest.raises(ValueError, match="spill_dir='' names no folder"):
        lms.LMS(spill_dir="")


def test_a_plan_that_empties_held_tensors_needs_free_held():
    plan = Plan(fingerprint="x", offload=(0,), num_entries=2, free_held=(0,), free_held_at=(3,))
    with pytest.raises(ValueError, match="free_held is off"):
        lms.LMS(plan=plan)
    lms.LMS(plan=plan, free_held=True)


def test_a_budget_that_does_not_hold_without_a_plan_warns_with_the_minimum(spill_dir, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    offload = lms.LMS(budget="64KiB", tier="disk", spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="lms"):
        for _ in range(2):
            with offload:
                model(torch.randn(512, 256)).sum().backward()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("did not hold this step" in m and "needs at least" in m for m in warned), warned


class _LeavesItsPlanLate(torch.nn.Module):
    """A wide layer (whose saved tensor sets the budget policy's reserve), then a chain of narrow
    ones; with ``late`` set, one more tensor is saved near the end, past what the plan knows."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Linear(512, 1536)
        self.narrow = torch.nn.Linear(1536, 512)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(24))
        self.late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.narrow(torch.relu(self.wide(x)))
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.late and i == 20:
                x = torch.sigmoid(x) * 2
        return x


def test_a_step_that_leaves_its_plan_late_answers_only_for_the_rest(spill_dir, caplog):
    """Note [A step that left its plan answers for the rest]: what the step kept while it
    followed its plan, past the budget policy's own allowance, is not reported as that policy
    failing the budget: the step kept it until it left the plan, as the plan was simulated to."""
    torch.manual_seed(0)
    model, x = _LeavesItsPlanLate(), torch.randn(1024, 512)

    def step(m: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    offload = lms.LMS(budget="90%", min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    offload.tune(model, [x], step)
    model.late = True
    with caplog.at_level(logging.WARNING, logger="lms"), offload:
        step(model, [x])
    assert offload.stats.diverged_steps == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("falling back" in m for m in warned), warned
    assert not any("did not hold this step" in m for m in warned), warned


def test_a_corrupt_image_under_data_is_named(tmp_path):
    import numpy as np
    from PIL import Image

    from lms.harness.train import load_images

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(2):
            pixels = (np.random.default_rng(i).random((40, 40, 3)) * 255).astype("uint8")
            Image.fromarray(pixels).save(tmp_path / name / f"{i}.png")
    bad = tmp_path / "b" / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 8)
    with pytest.raises(ValueError, match=r"--data image .*bad\.png.* cannot be read.*remove"):
        load_images(str(tmp_path), "resnet50", 32, 5)  # every image, the bad one among them


def test_the_spill_reserve_is_stated_and_configurable(spill_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    everything = {"tier": "disk", "spill_dir": spill_dir, "swapout_threshold": 1}
    offload = lms.LMS(spill_reserve="1000TiB", **everything)
    refused = pytest.raises(lms.SpillError, match=r"1000\.00 TiB it keeps free \(spill_reserve\)")
    with refused, offload:
        model(torch.randn(512, 256)).sum().backward()
    with lms.LMS(spill_reserve=0, **everything) as offload:
        model(torch.randn(512, 256)).sum().backward()
    assert offload.stats.offloaded_tensors > 0
    with pytest.raises(ValueError, match="spill_reserve"):
        lms.LMS(spill_reserve="lots")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_tracing_for_cuda_without_a_cuda_device_is_refused_before_the_step(monkeypatch):
    """Autograd asks the driver for a CUDA device even under fake tensors: a trace for one on a
    machine without any is refused before the model is built, pointing at device specs."""
    from lms.analysis import trace_step

    built = []
    with pytest.raises(ValueError, match="no CUDA device; trace on the CPU.*device_spec="):
        trace_step(
            lambda: built.append(1) or torch.nn.Linear(4, 4), [torch.ones(2, 4)], device="cuda"
        )
    assert built == []


@pytest.mark.parametrize("field", ["budget", "host_budget", "spill_reserve"])
def test_a_size_given_as_a_bare_number_in_a_string_is_refused_with_its_units(field):
    with pytest.raises(ValueError, match=rf"lms: {field}='60' has no unit; .*'60GiB'"):
        lms.LMS(**{field: "60"})
    assert lms.LMS(**{field: 60}).config is not None  # an int is bytes
    assert lms.parse_bytes("60B") == lms.parse_bytes(60) == 60


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "resnet50", "--budget", "60"],
        ["train", "--model", "resnet50", "--host-budget", "100"],
        ["bench", "--model", "resnet50", "--sizes", "64", "--budget", "8"],
        ["analyze", "--model", "resnet50", "--gpu-memory", "32"],
    ],
)
def test_a_size_without_its_unit_on_the_command_line_is_refused_before_any_work(
    argv, monkeypatch, capsys
):
    import lms.harness.zoo as zoo

    looked = []
    monkeypatch.setattr(zoo, "zoo_model", lambda *a, **k: looked.append(a))
    assert main(argv) == 2 and not looked
    err = capsys.readouterr().err
    assert "has no unit" in err and "GiB" in err
    assert ("share of the step's peak" in err) == (argv[-2] == "--budget")


def test_a_builder_that_needs_arguments_is_refused_naming_them_before_it_is_called(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "needy.py").write_text(
        "import torch\n"
        "CALLED = []\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, channels, classes, *, depth, width=8):\n"
        "        CALLED.append(1)\n"
        "        super().__init__()\n"
        "def plain(width=8):\n"
        "    return torch.nn.Conv2d(3, width, 3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["analyze", "--model", "needy:Net", "--image-size", "32"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs arguments to build (channels, classes, depth)" in err
    assert "def model(): return Net(channels=..., classes=..., depth=...)" in err
    import needy

    assert needy.CALLED == []  # refused before it ran
    from lms.harness.zoo import zoo_model

    assert zoo_model("needy:plain").unit == "pixels"  # defaults for all: built as it is
