"""`lms sweep`: the seed's protocol on the simulator."""

import json

import pytest
import torch

from lms.cli import main
from tests.conftest import check_schema


def test_sweep_finds_both_limits_and_writes_json_and_plot(tmp_path):
    out = tmp_path / "sweep.json"
    plot = tmp_path / "sweep.png"
    code = main(
        [
            "-q",
            "sweep",
            "--model",
            "torchvision.models:resnet18",  # a user's builder: planned in seconds
            "--gpu-memory",
            "0.8GiB",
            "--step",
            "512",
            "--max-size",
            "2048",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    check_schema("sweep", result)
    plain, with_lms = result["max_size_without_lms"], result["max_size_with_lms"]
    assert plain is not None and with_lms is not None and with_lms > plain
    points = result["points"]
    assert [p["size"] for p in points][:3] == [512, 1024, 1536]
    for point in points:
        assert point["peak_bytes"] > 0 and "fits_without_lms" in point
        if point["fits_without_lms"]:
            assert point["size"] <= plain
        elif point["fits_with_lms"]:
            assert point["lms_peak_bytes"] <= result["gpu_memory_bytes"]
            assert point["predicted_overhead"] >= 0
    assert result["elements_ratio"] == (with_lms / plain) ** 2
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_that_could_not_grow_or_fit_is_refused_before_tracing():
    from lms.harness.sweep import sweep

    for arguments, message in (
        (dict(gpu_memory="1GiB", step=0), "step=0 must be at least 1"),
        (dict(gpu_memory="1GiB", step=64, start=-64), "start=-64 must be at least 1"),
        (dict(gpu_memory=0, step=64), "gpu_memory=0 must be more than 0 bytes"),
    ):
        with pytest.raises(ValueError, match=message):
            sweep("resnet50", progress=False, **arguments)


def test_a_sweep_without_a_start_passes_over_sizes_the_model_rejects(caplog):
    """Note [A sweep finds its own start]: the 3D U-Net cannot take 16^3 (its norms see one
    voxel); a sweep by 16 starts at 32 and says so, and a start given at 16 is the model's
    error, before any point."""
    import logging

    pytest.importorskip("monai")
    from lms.core.errors import StepFailedError
    from lms.harness.sweep import sweep

    with caplog.at_level(logging.INFO, logger="lms.harness.sweep"):
        result = sweep("unet3d", gpu_memory="32GiB", step=16, max_size=32, progress=False)
    assert [p["size"] for p in result["points"]] == [32]
    assert "unet3d rejects sizes 16" in caplog.text and "starts at 32" in caplog.text
    with pytest.raises(StepFailedError, match="spatial element"):
        sweep("unet3d", gpu_memory="32GiB", step=16, start=16, max_size=32, progress=False)


class _UpTo32(torch.nn.Module):
    """A net that takes images of at most 32 px, as a ViT takes only its own size."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        if x.shape[-1] > 32:
            raise ValueError(f"this net takes at most 32 px, not {x.shape[-1]}")
        return self.conv(x)


def up_to_32():
    return _UpTo32()


def test_a_sweep_ends_where_the_model_rejects_a_larger_size(caplog):
    """Note [A sweep finds its own start]: a size the model refuses after one it took ends the
    sweep with what it found, and says which and why."""
    import logging

    from lms.harness.sweep import sweep

    with caplog.at_level(logging.WARNING, logger="lms.harness.sweep"):
        result = sweep(
            "tests.planning.test_sweep:up_to_32", gpu_memory="1GiB", step=16, progress=False
        )
    assert [p["size"] for p in result["points"]] == [16, 32]
    assert result["rejected"]["size"] == 48 and "at most 32 px" in result["rejected"]["error"]
    assert result["max_size_with_lms"] == 32
    assert "rejects size 48" in caplog.text and "ends at 32" in caplog.text
    check_schema("sweep", {"lms_version": "x", "torch_version": "y", **result})
