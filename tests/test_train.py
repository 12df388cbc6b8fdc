"""`lms train` and `lms bench`: real loops, the peers, and the summary they report."""

import contextlib
import json
import pathlib
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

from lms.analysis import trace_step
from lms.cli import main
from lms.core.errors import StepFailedError
from lms.harness.bench import summarize
from lms.harness.train import checkpoint_blocks, train
from lms.harness.zoo import ZOO, zoo_model
from tests.conftest import check_schema, script_json


def test_every_method_trains_and_measures():
    results = {
        method: train(
            "resnet50",
            size=64,
            batch_size=2,
            steps=2,
            method=method,
            budget="2GiB" if method == "lms" else None,
            progress=False,
            device="cpu",
        )
        for method in ("none", "lms", "save_on_cpu", "checkpoint")
    }
    # on a CPU the peak counts what each step starts with, as a budget and the simulator do
    entry = ZOO["resnet50"]
    trace = trace_step(entry.build, lambda: entry.make_batch(64, 2), entry.step_fn, device="cpu")
    start = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    for result in results.values():
        assert result.step_s > 0 and result.elements_per_s > 0 and result.unit == "pixels"
        assert result.start_bytes == start
        assert result.peak_bytes > start  # and the step's activations on top
    # the same weights, data and seed: the same first loss for every method
    losses = {round(r.loss, 5) for r in results.values()}
    assert len(losses) == 1, losses
    assert results["lms"].lms_stats is not None


def test_a_step_far_from_its_plan_says_where_the_op_times_came_from(tmp_path, monkeypatch):
    """A step 2.5 times faster (or 3 times slower) than its plan predicted names the plan cache
    that keeps the op times it was priced at; one 1.5 times slower says nothing."""
    from lms.harness.train import far_from_plan

    monkeypatch.setenv("LMS_CACHE_DIR", str(tmp_path))
    fast = far_from_plan(1.0, 2.5)
    assert fast is not None and "0.40x" in fast and str(tmp_path) in fast
    assert "LMS_CACHE_DIR" in fast
    slow = far_from_plan(3.0, 1.0)
    assert slow is not None and "3.00x" in slow
    assert far_from_plan(1.5, 1.0) is None and far_from_plan(1.0, 0.0) is None


def test_checkpoint_blocks_wraps_blocks_only():
    model = checkpoint_blocks(ZOO["resnet50"].build())
    assert type(model.layer1).__name__ == "_Checkpointed"
    assert type(model.conv1) is torch.nn.Conv2d


def test_summary_finds_largest_sizes_and_slowdowns():
    def point(size, method, step_s, fits=True):
        return {"size": size, "method": method, "step_s": step_s, "fits": fits}

    points = [
        point(1, "none", 1.0),
        point(1, "lms", 1.1),
        point(2, "none", 2.0, fits=False),
        point(2, "lms", 2.5),
        point(3, "lms", 4.0, fits=False),
    ]
    result = summarize("m", points, 100, ["none", "lms"])
    assert result["largest_size"] == {"none": 1, "lms": 2}
    assert abs(result["slowdown_vs_none"]["lms"]["1"] - 0.1) < 1e-9


def test_cli_train_writes_json(tmp_path):
    out = tmp_path / "train.json"
    assert (
        main(
            [
                "-q",
                "train",
                "--model",
                "unet3d",
                "--image-size",
                "32",
                "--steps",
                "2",
                "--budget",
                "2GiB",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    check_schema("train", result)
    assert result["unit"] == "voxels" and result["method"] == "lms"
    assert result["plan"]["base_step_s"] > 0
    assert result["elements_per_s"] == result["samples_per_s"] * 32**3


def test_cli_train_infeasible_budget_fails_before_training(capsys):
    code = main(
        [
            "-q",
            "train",
            "--model",
            "resnet50",
            "--image-size",
            "128",
            "--steps",
            "2",
            "--budget",
            "1MiB",
        ]
    )
    assert code == 3  # EXIT_NO_PLAN
    assert "raise the budget" in capsys.readouterr().err


def test_a_budget_can_be_a_share_of_the_simulated_plain_peak():
    """``--budget 60%``: that share of the step's peak without offload, as simulated on the
    device it trains on; here below TinyLM's floor, so refused before training, naming it."""
    from lms.analysis import simulate
    from lms.core.errors import PlanInfeasibleError
    from lms.core.units import format_bytes
    from lms.orchestration.local import local_device_spec

    entry = ZOO["tinylm"]
    torch.manual_seed(0)
    model, batch = entry.build(), list(entry.make_batch(512, 1))
    trace = trace_step(model, batch, entry.step_fn, device="cpu")
    peak = simulate(trace, None, local_device_spec(torch.device("cpu"))).peak_bytes
    with pytest.raises(PlanInfeasibleError) as refused:
        train("tinylm", size=512, steps=1, budget="60%", progress=False)
    assert f"budget {format_bytes(int(0.6 * peak))} is below" in str(refused.value)


@pytest.mark.parametrize("budget", ["0%", "150%", "sixty%"])
def test_a_share_outside_the_peak_is_refused_before_any_work(budget):
    with pytest.raises(ValueError, match="not a share of the peak"):
        train("tinylm", size=512, steps=1, budget=budget, progress=False)


@pytest.mark.parametrize(
    ("per_s", "unit", "text"),
    [
        (45.2, "tokens", "45.2 tokens/s"),
        (999.9, "voxels", "1 kvoxels/s"),
        (25.2e6, "pixels", "25.2 Mpixels/s"),
        (3.4e9, "pixels", "3.4 Gpixels/s"),
    ],
)
def test_rates_keep_three_significant_figures(per_s, unit, text):
    from lms.core.units import format_rate

    assert format_rate(per_s, unit) == text


def test_cli_analyzes_an_imported_builder_and_refuses_bad_names(tmp_path, capsys):
    out = tmp_path / "r.json"
    model = "torchvision.models:mobilenet_v3_small"
    assert main(["-q", "analyze", "--model", model, "--image-size", "256", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"].startswith(model) and report["num_ops"] > 100
    for bad in ("resnet5", "no.such.module:build", "torchvision.models:no_such_net"):
        assert main(["analyze", "--model", bad, "--image-size", "64"]) == 2
        assert "lms: model=" in capsys.readouterr().err
    refused = pytest.raises(ValueError, zoo_model, "resnet5").value
    assert "a torchvision model's name" in str(refused)


def test_a_torchvision_name_is_a_model_built_with_random_weights_throughout(
    tmp_path, capsys, monkeypatch
):
    """A segmentation model's backbone, which torchvision would load pretrained, is random too:
    nothing is downloaded. -q also after the command's name."""

    import torchvision

    def download(*args, **kwargs):
        raise AssertionError("a zoo model downloaded weights")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", download)
    out = tmp_path / "r.json"
    for model in ("mobilenet_v3_small", "lraspp_mobilenet_v3_large"):
        argv = ["analyze", "-q", "--model", model, "--image-size", "64", "--json", str(out)]
        assert main(argv) == 0
        report = json.loads(out.read_text())
        assert report["model"].startswith(model) and report["input_shapes"][0] == [1, 3, 64, 64]
    assert "[LMS]" not in capsys.readouterr().err


def test_a_torchvision_video_model_is_fed_clips_and_a_detector_is_refused(tmp_path, capsys):
    """A video model takes clips of its recipe's frames, each --image-size square (MViT takes no
    other); a detector or an optical flow model, whose batch the zoo cannot make, is refused
    before any work, naming the way on."""
    entry = zoo_model("r3d_18")
    inputs, targets = entry.make_batch(32, 2)
    assert list(inputs.shape) == [2, 3, 16, 32, 32] and list(targets.shape) == [2]
    assert entry.elements(32) == 16 * 32 * 32
    for model in ("fasterrcnn_resnet50_fpn", "raft_small"):
        assert main(["analyze", "--model", model, "--image-size", "64"]) == 2
        assert "around your own step" in capsys.readouterr().err


def volume_segmenter():
    """A builder of a user's own: 2 channels of 3D volumes in, 3 classes a voxel out."""
    return torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(4, 3, 1)
    )


class _LateStem(torch.nn.Module):
    """Its cells defined before the stem that runs first, as MONAI's DiNTS does."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Conv3d(6, 6, 3, padding=1)
        self.stem = torch.nn.Conv3d(1, 6, 3, padding=1)
        self.head = torch.nn.Conv3d(6, 2, 1)

    def forward(self, x):
        return self.head(self.cell(self.stem(x)))


def late_stem():
    """1 channel of 3D volumes in (the convolution it runs first), 2 classes a voxel out."""
    return _LateStem()


class _WideLateStem(torch.nn.Module):
    """A cell of 2048 channels defined before the 1-channel stem that runs first: a batch of
    the cell's channels at 64 voxels would take 2 GiB."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Conv3d(2048, 2, 1)
        self.stem = torch.nn.Conv3d(1, 2048, 1)

    def forward(self, x):
        return self.cell(self.stem(x))


def wide_late_stem():
    return _WideLateStem()


def signal_regressor():
    """1D signals of 1 channel in, one value a sample out."""
    return torch.nn.Sequential(
        torch.nn.Conv1d(1, 4, 9), torch.nn.AdaptiveAvgPool1d(1), torch.nn.Flatten(),
        torch.nn.Linear(4, 1),
    )  # fmt: skip


class _Waveforms(torch.nn.Module):
    """Raw audio in, [batch, samples], given its one channel here (as wav2vec 2.0 does); a
    parameter made by a constructor that ignores the default device, and a layer dropped when a
    random draw says so, as wav2vec 2.0's encoder does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3, padding=1)
        self.shift = torch.nn.Parameter(torch.Tensor(4).zero_())
        self.layer = torch.nn.Conv1d(4, 4, 1)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        hidden = self.conv(waveform[:, None]) + self.shift[:, None]
        if torch.rand([]) >= 0.1:  # the layer's drop
            hidden = self.layer(hidden)
        return hidden


def waveform_encoder():
    return _Waveforms()


def drop_rated_segmenter():
    """Reads a tensor's value as it builds (as SwinUNETR takes its drop rates from a
    ``linspace``), which the meta device cannot give."""
    rate = torch.linspace(0, 0.2, 3)[1].item()
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Dropout(rate), torch.nn.Conv2d(4, 2, 1)
    )


class _AsTensorResidual(torch.nn.Module):
    """A residual block that wraps its skip in ``torch.as_tensor`` (as MONAI's HighResNet does):
    a tensor factory, which a default device would move to its own."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x) + torch.as_tensor(x)


def as_tensor_residual():
    return _AsTensorResidual()


def no_convolution():
    return torch.nn.Linear(4, 4)


class _Registration(torch.nn.Module):
    """Two volumes in, as an image registration network takes them."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 3, 3)

    def forward(self, moving, fixed):
        return self.conv(torch.cat([moving, fixed], 1))


def two_inputs():
    return _Registration()


def pooled_classifier():
    """Images pooled by a 5-pixel window: too small an image fails in the pooling's shape check."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AvgPool2d(5), torch.nn.Flatten())


class _Tiled(torch.nn.Module):
    """Takes images whose edge is a multiple of ``tile`` alone, as a model of fixed tiles does."""

    def __init__(self, tile: int):
        super().__init__()
        self.tile = tile
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        if x.shape[-1] % self.tile:
            raise ValueError(f"the edge must be a multiple of {self.tile}, got {x.shape[-1]}")
        return self.conv(x).mean((2, 3))


def tiled_by_64():
    return _Tiled(64)


def tiled_by_1000():
    return _Tiled(1000)


def pooled_then_normalized():
    """A BatchNorm after pooling to one pixel (an auxiliary classifier's): one value a channel
    in a sample, which training mode refuses."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
    )


def lazy_classifier():
    """A lazy module, whose parameters its first call makes."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))


class _MeanOverTokens(torch.nn.Module):
    def forward(self, x):
        return x.mean(1)


def token_classifier():
    """Tokens of a vocabulary of 50 in, 3 classes a sequence out."""
    return torch.nn.Sequential(torch.nn.Embedding(50, 8), _MeanOverTokens(), torch.nn.Linear(8, 3))


def tiny_llama():
    """A Hugging Face causal LM: its output's logits have a class a token, on the last dim."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny_mixtral():
    """A Hugging Face mixture of experts: its experts' products are one grouped product."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def tiny_gpt_oss():
    """A mixture of experts whose grouped products take the experts' weights as they are."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["full_attention"],
    )  # fmt: skip
    return transformers.GptOssForCausalLM(config)


def tiny_vit():
    """A Hugging Face vision transformer that takes images of 32 px only, as its config says."""
    import transformers

    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def tiny_bart():
    """A Hugging Face encoder-decoder model: its decoder runs on tokens made from its labels."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def tiny_whisper():
    """A Hugging Face encoder-decoder model of speech: spectrogram frames in (exactly twice its
    source positions), tokens out, at most its target positions."""
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=4,
        max_source_positions=6, max_target_positions=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


@pytest.mark.parametrize(
    "builder, shapes",
    [
        ("volume_segmenter", [[1, 2, 12, 12, 12], [1, 12, 12, 12]]),
        ("late_stem", [[1, 1, 12, 12, 12], [1, 12, 12, 12]]),
        ("drop_rated_segmenter", [[1, 1, 12, 12], [1, 12, 12]]),
        ("as_tensor_residual", [[1, 2, 12, 12], [1, 12, 12]]),
        ("signal_regressor", [[1, 1, 12], [1, 1]]),
        ("waveform_encoder", [[1, 12], [1, 12]]),
        ("token_classifier", [[1, 12], [1]]),
        ("tiny_llama", [[1, 12], [1, 12]]),
        ("tiny_bart", [[1, 12], [1, 12]]),
        ("tiny_whisper", [[1, 4, 12], [1, 8]]),
    ],
)
def test_an_imported_builder_is_fed_what_its_first_convolution_takes(builder, shapes, tmp_path):
    """Volumes of the first convolution's channels, classes a voxel where the output has them,
    a regression on one output channel, tokens of the first embedding's vocabulary with a class
    a sequence or a token; the step trains in each."""
    out = tmp_path / "r.json"
    argv = ["-q", "analyze", "--model", f"tests.test_train:{builder}", "--image-size", "12"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["input_shapes"] == shapes
    tokens = builder in ("token_classifier", "tiny_llama", "tiny_bart")
    assert (" 12 tokens " in report["model"]) == tokens  # named by what it takes
    argv = ["-q", "train", "--model", f"tests.test_train:{builder}", "--image-size", "12"]
    assert main([*argv, "--steps", "1", "--budget", "1GiB", "--json", str(out)]) == 0


@pytest.mark.parametrize(
    "builder, shape", [("volume_segmenter", [1, 2, 96, 96, 96]), ("token_classifier", [1, 512])]
)
def test_a_model_without_a_size_is_taken_at_its_default(builder, shape, tmp_path, caplog):
    out = tmp_path / "r.json"
    with caplog.at_level("INFO", logger="lms"):
        argv = ["analyze", "--model", f"tests.test_train:{builder}", "--json", str(out)]
        assert main(argv) == 0
    assert json.loads(out.read_text())["input_shapes"][0] == shape
    assert "at its default size" in caplog.text


def test_a_default_size_the_model_rejects_gives_way_to_the_first_it_takes(tmp_path, caplog):
    """Note [A default size the model rejects]: 224 px is no multiple of 64, 256 is; a size the
    user gives is refused as it is, and a model that takes none up to twice the default is
    refused at it."""
    out = tmp_path / "r.json"
    with caplog.at_level("INFO", logger="lms"):
        argv = ["analyze", "--model", "tests.test_train:tiled_by_64", "--json", str(out)]
        assert main(argv) == 0
    assert json.loads(out.read_text())["input_shapes"][0] == [1, 3, 256, 256]
    assert "rejects its default, 224 px (ValueError: the edge must be a multiple of 64" in (
        caplog.text
    )
    argv = ["-q", "analyze", "--model", "tests.test_train:tiled_by_64", "--image-size", "224"]
    assert main([*argv, "--json", str(out)]) == 2
    argv = ["-q", "analyze", "--model", "tests.test_train:tiled_by_1000", "--json", str(out)]
    assert main(argv) == 2


@pytest.mark.parametrize(
    "builder, size", [("tiny_vit", 32), ("tiny_bart", 32), ("tiny_llama", 512)]
)
def test_a_hugging_face_model_is_taken_at_the_size_its_config_sets(builder, size):
    """A vision model's config sets its images' size, which no other size passes; a language
    model's its most positions, where fewer than the default 512 tokens."""
    pytest.importorskip("transformers")
    entry = zoo_model(f"tests.test_train:{builder}")
    assert entry.default_size == size
    inputs, _ = entry.make_batch(entry.default_size, 1)
    assert inputs.shape[-1] == size


def test_a_torchvision_model_is_taken_at_the_size_its_weights_crop_to():
    """Inception v3's weights crop to 299 px, and at 224 its auxiliary classifier's 5x5
    convolution is larger than its input; the video models' to 112."""
    pytest.importorskip("torchvision")
    assert zoo_model("inception_v3").default_size == 299
    assert zoo_model("r3d_18").default_size == 112
    assert zoo_model("resnet18").default_size == 224
    inputs, _ = zoo_model("inception_v3").make_batch(299, 2)
    assert inputs.shape == (2, 3, 299, 299)


@pytest.mark.parametrize("builder", ["tiny_mixtral", "tiny_gpt_oss"])
def test_a_mixture_of_experts_in_single_precision_is_fed_its_tokens(builder):
    """Note [Grouped products the CPU takes in single precision]: the probe for the output's
    shape, on the meta device, takes the experts' float32 grouped product as the CPU does, with
    the model's real weights (GPT-OSS's) as with fake ones."""
    pytest.importorskip("transformers")
    inputs, labels = zoo_model(f"tests.test_train:{builder}").make_batch(12, 2)
    assert inputs.shape == labels.shape == (2, 12) and int(labels.max()) < 40


def test_a_size_the_model_cannot_take_is_refused_once(caplog, capsys):
    """Note [A failed shape check is told once]: the error names the failed check, and the fake
    tensors' log of its traceback is left out."""
    argv = ["analyze", "--model", "tests.test_train:pooled_classifier", "--image-size", "6"]
    with caplog.at_level("DEBUG"):
        assert main(argv) == 2
    assert "Output size is too small" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def test_a_builder_of_a_lazy_module_is_refused_naming_it(capsys):
    argv = ["analyze", "--model", "tests.test_train:lazy_classifier", "--image-size", "8"]
    assert main(argv) == 2
    assert "Sequential.2 (LazyLinear) is a lazy module" in capsys.readouterr().err


def test_an_imported_builder_without_a_convolution_is_refused_naming_the_way_on(capsys):
    argv = ["analyze", "--model", "tests.test_train:no_convolution", "--image-size", "8"]
    assert main(argv) == 2
    refused = capsys.readouterr().err
    assert "has neither a convolution nor an embedding, so its input cannot be told" in refused


def test_channel_counts_tried_in_vain_are_probed_without_a_batch_of_them():
    """Note [The convolution that runs first]: the batch a probe fails on is never filled (the
    2048 channels' would take 2 GiB), measured in a process of its own."""
    code = (
        "import resource; from lms.harness.zoo import zoo_model; "
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "inputs, _ = zoo_model('tests.test_train:wide_late_stem').make_batch(64, 1); "
        "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before; "
        "print(list(inputs.shape), grown * 1024)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    shape, grown = done.stdout.split("]")
    assert shape == "[1, 1, 64, 64, 64"
    assert int(grown) < 512 * 2**20, done.stdout


def test_an_imported_builder_of_a_model_of_two_inputs_is_refused_naming_them(capsys):
    argv = ["analyze", "--model", "tests.test_train:two_inputs", "--image-size", "8"]
    assert main(argv) == 2
    refused = capsys.readouterr().err
    assert "takes 2 inputs (moving, fixed)" in refused and "your own step" in refused


def test_cli_keeps_named_submodules_on_the_device_and_refuses_other_names(tmp_path, capsys):
    movable = []
    for keep in ([], ["--no-offload-in", "conv_0", "--no-offload-in", "upcat_1"]):
        out = tmp_path / "r.json"
        args = ["-q", "analyze", "--model", "unet3d", "--image-size", "32", "--json", str(out)]
        assert main([*args, *keep]) == 0
        movable.append(json.loads(out.read_text())["movable_storages"])
    assert movable[0] > movable[1] > 0  # what the first and last blocks save stays
    assert main(["train", "--model", "unet3d", "--image-size", "32", "--no-offload-in", "x"]) == 2
    assert "BasicUNet has no submodule 'x'; its top-level ones: conv_0, down_1" in (
        capsys.readouterr().err
    )


def test_deeplabv3_refuses_a_batch_of_one_and_defaults_to_two(tmp_path, capsys):
    from lms.harness.bench import bench

    with pytest.raises(ValueError, match="deeplabv3 trains on batches of 2 or more"):
        train("deeplabv3", size=64, batch_size=1, steps=1, method="none", device="cpu")
    with pytest.raises(ValueError, match="got batch size 1"):
        bench("deeplabv3", sizes=[64], budget=None, methods=["none"], batch_size=1)
    assert main(["analyze", "--model", "deeplabv3", "--image-size", "64", "--batch-size", "1"]) == 2
    assert "BatchNorm after its image pooling" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert (
        main(["-q", "analyze", "--model", "deeplabv3", "--image-size", "64", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["model"] == "deeplabv3 64 px batch 2" and report["input_shapes"][0][0] == 2


def test_an_imported_builder_normalizing_one_value_a_channel_defaults_to_a_batch_of_two(
    tmp_path, capsys, caplog
):
    """Note [A sample of one value per channel]: without --batch-size, a builder that fails on a
    sample alone for that reason is fed two; asked for one, it is refused with its own error."""
    out = tmp_path / "r.json"
    argv = ["analyze", "--model", "tests.test_train:pooled_then_normalized", "--image-size", "12"]
    with caplog.at_level("INFO", logger="lms"):
        assert main([*argv, "--json", str(out)]) == 0
    assert "trains on batches of 2 or more" in caplog.text
    assert json.loads(out.read_text())["input_shapes"] == [[2, 3, 12, 12], [2]]
    assert main([*argv, "--batch-size", "1"]) == 2
    assert "Expected more than 1 value per channel" in capsys.readouterr().err
    # a builder that takes a sample alone keeps the batch of one
    argv = ["-q", "analyze", "--model", "tests.test_train:pooled_classifier", "--image-size", "12"]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["input_shapes"][0][0] == 1


def test_bench_rotates_the_methods_and_keeps_each_median(monkeypatch):
    from lms.harness import bench as compare

    order = []
    times = {"none": iter([3.0, 1.0, 1.5]), "lms": iter([5.0, 4.0, 9.0])}

    def fake_run(arguments, timeout_s):
        method, size = arguments["method"], arguments["size"]
        order.append((size, method))
        if method == "none" and size == 128:  # over the budget at the second size
            return {
                "ok": True,
                "step_s": 1.0,
                "peak_bytes": 2048,
                "elements_per_s": 1.0,
                "unit": "pixels",
            }
        step_s = next(times[method]) if size == 64 else 1.0
        return {
            "ok": True,
            "step_s": step_s,
            "peak_bytes": 100 + len(order),
            "elements_per_s": 1.0,
            "unit": "pixels",
        }

    monkeypatch.setattr(compare, "_run", fake_run)
    result = compare.bench(
        "resnet50", sizes=[64, 128, 256], budget=1024, methods=["none", "lms"], repeats=3
    )
    # Rounds alternate which method goes first; a method over budget runs no more.
    assert order[:6] == [(64, "none"), (64, "lms"), (64, "lms"), (64, "none")] + [
        (64, "none"),
        (64, "lms"),
    ]
    assert order.count((128, "none")) == 1 and (256, "none") not in order
    points = {(p["size"], p["method"]): p for p in result["points"]}
    assert points[64, "none"]["step_s"] == 1.5 and points[64, "none"]["step_s_runs"] == [3, 1, 1.5]
    assert points[64, "lms"]["step_s"] == 5.0
    assert points[64, "lms"]["peak_bytes"] == max(
        100 + i for i, r in enumerate(order, 1) if r == (64, "lms")
    )
    assert result["slowdown_vs_none"]["lms"] == {"64": 5.0 / 1.5 - 1}
    assert result["largest_size"] == {"none": 64, "lms": 256}
    with pytest.raises(ValueError, match="repeats=0"):
        compare.bench("resnet50", sizes=[64], budget=None, repeats=0)
    runs = len(order)
    with pytest.raises(ValueError, match="must name one or more of none, lms, lms_free_held"):
        compare.bench("resnet50", sizes=[64], budget=None, methods=["none", "lsm"])
    with pytest.raises(ValueError, match="runs every size in the same memory: give it in bytes"):
        compare.bench("resnet50", sizes=[64, 128], budget="60%")
    assert len(order) == runs  # refused before any run


def test_fewer_than_one_step_fails_before_anything_runs(capsys):
    from lms.harness.bench import bench

    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        train("resnet50", size=64, steps=0, method="none", device="cpu")
    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        bench("resnet50", sizes=[64], budget=None, steps=0)
    with pytest.raises(ValueError, match="size=0 must be at least 1"):
        train("resnet50", size=0, method="none", device="cpu")
    for sizes in ([], [64, 0]):
        with pytest.raises(ValueError, match="must be one or more edges of at least 1"):
            bench("resnet50", sizes=sizes, budget=None)
    with pytest.raises(SystemExit) as usage:
        main(["demo", "--steps", "0"])
    assert usage.value.code == 2
    assert "argument --steps: 0 must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--model", "resnet50", "--image-size", "-5"], "--image-size: -5 must be at"),
        (["analyze", "--model", "resnet50", "--image-size", "0"], "--image-size: 0 must be at"),
        (["bench", "--model", "resnet50", "--sizes", "256,x"], "--sizes: 'x' is not a whole"),
        (["bench", "--model", "resnet50", "--sizes", ""], "--sizes: '' is not a whole"),
        (["bench", "--model", "resnet50", "--sizes", "64", "--run-timeout", "0"], "0 must be"),
        (["sweep", "--model", "resnet50", "--gpu-memory", "1GiB", "--step", "0"], "--step: 0"),
        (["train", "--model", "unet3d", "--image-size", "32", "--batch-size", "0"], "size: 0"),
    ],
)
def test_cli_refuses_numbers_out_of_range_as_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as usage:
        main(argv)
    assert usage.value.code == 2
    assert message in capsys.readouterr().err


def _image_folder(root, per_class):
    from PIL import Image

    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for number in range(per_class):
            pixels = torch.randint(0, 256, (40, 50, 3), dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(root / name / f"{number}.png")
    return str(root)


def test_cli_trains_on_a_folder_of_images_and_refuses_what_cannot_feed_the_model(tmp_path, capsys):
    folder = _image_folder(tmp_path / "images", per_class=2)
    out = tmp_path / "train.json"
    argv = ["-q", "train", "--model", "resnet50", "--image-size", "64", "--steps", "1"]
    assert main([*argv, "--batch-size", "4", "--data", folder, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["batch_size"] == 4
    (tmp_path / "empty").mkdir()
    refusals = {
        "holds 4 images, fewer than the batch size 5": [*argv, "--batch-size", "5"],
        "Couldn't find any class folder": [*argv, "--data", str(tmp_path / "empty")],
        "No such file or directory": [*argv, "--data", str(tmp_path / "missing")],
        "unet3d takes voxels": ["train", "--model", "unet3d", "--image-size", "32"],
    }
    for message, refused in refusals.items():
        if "--data" not in refused:
            refused = [*refused, "--data", folder]
        assert main(refused) == 2
        assert message in capsys.readouterr().err


def test_cli_bench_measures_each_run_in_its_own_process(tmp_path):
    out, plot = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["-q", "bench", "--model", "resnet50", "--sizes", "64"]
    argv += ["--methods", "none,lms_free_held", "--steps", "1", "--repeats", "1"]
    argv += ["--json", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    check_schema("bench", result)
    assert [(p["method"], p["fits"], len(p["step_s_runs"])) for p in result["points"]] == [
        ("none", True, 1),
        ("lms_free_held", True, 1),
    ]
    assert all(
        p["step_s"] in p["step_s_runs"] and p["elements_per_s"] > 0 for p in result["points"]
    )
    assert plot.stat().st_size > 0


def test_cli_train_refuses_a_bad_host_budget_before_training(capsys):
    argv = ["-q", "train", "--model", "resnet50", "--image-size", "64", "--batch-size", "2"]
    assert main([*argv, "--steps", "1", "--host-budget", "lots"]) == 2
    assert "--host-budget='lots' is not a size" in capsys.readouterr().err  # the flag typed


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--model", "resnet50", "--sizes", "64", "--budget", "70%"],
        ["sweep", "--model", "resnet50", "--gpu-memory", "70%"],
    ],
    ids=["bench", "sweep"],
)
def test_a_share_given_to_a_command_of_several_sizes_is_refused_naming_those_that_take_one(
    argv, capsys, monkeypatch
):
    from lms.harness import zoo

    monkeypatch.setattr(zoo, "zoo_model", lambda name: pytest.fail("the zoo was consulted"))
    assert main(["-q", *argv]) == 2
    err = capsys.readouterr().err
    assert f"='70%' is a share of one step's peak, and lms {argv[0]} runs several sizes" in err
    assert "lms train --budget and lms analyze --gpu-memory take a share" in err


@pytest.mark.parametrize("method", ["lms", "none"])
def test_a_step_the_model_cannot_take_is_a_typed_error_before_training(method, capsys):
    """ResNet50 at 32 px, batch 1: its last batch norm sees one value per channel."""
    argv = ["train", "--model", "resnet50", "--image-size", "32", "--batch-size", "1", "--steps=2"]
    argv += ["--budget", "1GiB"] if method == "lms" else ["--no-lms"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "raised ValueError: Expected more than 1 value per channel" in err
    assert "functional.py" in err and "in _verify_batch_size" in err
    assert ("traced under fake tensors" in err) == (method == "lms")
    with pytest.raises(StepFailedError) as raised:
        train("resnet50", size=32, batch_size=1, steps=2, method=method, budget="1GiB")
    assert isinstance(raised.value.__cause__, ValueError)
    assert raised.value.where.endswith("in _verify_batch_size")


@pytest.mark.serial
def test_the_demo_trains_past_its_budget_within_it_as_simulated(tmp_path):
    """The main job, in a fresh process: its measured peak (the weights and batch the step
    starts with, then the heap's growth) stays within the budget, near the simulated peak."""
    script = (
        "import json, sys; from lms.harness.demo import run_demo; "
        "print(json.dumps(run_demo(out_dir=sys.argv[1], steps=2)))"
    )
    figures = script_json(script, tmp_path)
    measured, budget = figures["measured_peak_bytes"], figures["budget_bytes"]
    assert measured <= budget < figures["plain_peak_bytes"] / 2
    # the step's timing can leave it below the simulation (2.6% on a busy machine), not far
    assert 0.95 * figures["predicted_peak_bytes"] < measured
    assert (tmp_path / "memory.png").stat().st_size > 0
    assert (tmp_path / "memory_snapshot.pickle").stat().st_size > 0


def test_a_bench_run_that_was_killed_leaves_nothing_in_the_spill_folder(tmp_path, monkeypatch):
    """Note [Spill files have no name]: a run killed with spill files open leaves none behind, and
    the bench still sweeps folders older releases left (`_remove_stale_spills`)."""
    from lms.harness import bench as compare

    child = (
        "import os, signal, torch, lms\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])\n"
        "model[-1].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))\n"
        "with lms.LMS(tier='disk', swapout_threshold=1, min_offload_bytes=0):\n"
        "    model(torch.randn(256, 256)).sum().backward()\n"
    )
    monkeypatch.setattr(compare, "_CHILD", child)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's default spill directory
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    remove = compare._remove_stale_spills

    def spy():
        seen.append(sorted(path.name for path in tmp_path.glob("*lms*")))
        remove()

    monkeypatch.setattr(compare, "_remove_stale_spills", spy)
    result = compare._run({}, timeout_s=120)
    assert not result["ok"]
    assert seen == [[]]  # after the killed run, before the sweep: nothing of lms there
    assert [path for path in tmp_path.rglob("*") if path.is_file() and "lms" in path.name] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="trains on the GPU there (tests/gpu)")
def test_a_memory_snapshot_of_a_cpu_run_is_refused_before_training(tmp_path, capsys):
    path = tmp_path / "steps.pickle"
    argv = ["-q", "train", "--model", "resnet50", "--image-size", "64", "--batch-size", "2"]
    assert main([*argv, "--steps", "1", "--memory-snapshot", str(path)]) == 2
    assert "memory_snapshot" in capsys.readouterr().err and not path.exists()


def test_hugging_face_checkpointing_is_a_peer_for_its_models():
    """Both Hugging Face peers train the model to the plain step's loss, through the current
    ``activation_checkpointing_enable`` (no deprecation warning); a model without it is
    refused, naming the method to use."""
    pytest.importorskip("transformers")
    from lms.harness.train import train

    llama = "tests.test_train:tiny_llama"
    plain = train(llama, size=16, steps=1, method="none", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for method in ("hf_checkpoint", "hf_offload"):
            result = train(llama, size=16, steps=1, method=method, progress=False)
            assert result.method == method and result.peak_bytes > 0
            assert result.loss == plain.loss
    with pytest.raises(ValueError, match="hf_checkpoint takes a Hugging Face model"):
        train("tinylm", size=16, steps=1, method="hf_checkpoint", progress=False)


def test_a_bench_of_hugging_face_checkpointing_on_another_model_is_refused_before_any_run(
    monkeypatch, capsys
):
    import lms.harness.bench as bench

    ran = []
    monkeypatch.setattr(bench, "_run", lambda *a, **k: ran.append(1))
    argv = ["bench", "--model", "resnet50", "--sizes", "64", "--methods", "none,hf_checkpoint"]
    assert main([*argv, "--budget", "1GiB"]) == 2 and not ran
    assert "hf_checkpoint takes a Hugging Face model" in capsys.readouterr().err


def test_an_older_hugging_face_release_checkpoints_but_cannot_offload():
    """Releases of `transformers` before ``activation_checkpointing_enable`` still checkpoint
    through ``gradient_checkpointing_enable``; offloading is refused, naming the upgrade."""
    from lms.harness.train import hugging_face_checkpointing

    class Older(torch.nn.Module):
        enabled = 0

        def gradient_checkpointing_enable(self):
            self.enabled += 1

    model = Older()
    hugging_face_checkpointing(model, "older", offload=False)()
    assert model.enabled == 1
    with pytest.raises(ValueError, match="hf_offload needs a transformers release.*upgrade"):
        hugging_face_checkpointing(model, "older", offload=True)()
    assert model.enabled == 1


def test_the_compile_peer_compiles_its_model_under_the_activation_budget(monkeypatch):
    """Method compile_budget: the model goes through torch.compile, whose partitioner reads
    ``activation_memory_budget`` while the first step compiles it (here a stand-in compiler
    notes the setting each time the model runs)."""
    import torch._functorch.config as functorch_config

    from lms.harness.train import COMPILE_BUDGET

    seen = []

    def compiled(model):
        def run(*args, **kwargs):
            seen.append(functorch_config.activation_memory_budget)
            return model(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", compiled)
    before = functorch_config.activation_memory_budget
    result = train("tinylm", size=32, steps=2, method="compile_budget", progress=False)
    assert seen == [COMPILE_BUDGET] * 2 and before != COMPILE_BUDGET
    assert functorch_config.activation_memory_budget == before  # restored
    assert result.method == "compile_budget" and result.step_s > 0


def test_a_zoo_step_under_amp_leaves_autocast_casts_to_autograd(spill_dir):
    """Note [The zoo's steps let go of autocast's casts]: traced under autocast, backward
    included, the weights' bfloat16 casts are not held by the step's code, so a plan may move
    them; the step with LMS stays bitwise that without."""
    import lms

    entry = zoo_model("tests.test_train:tiny_llama")
    torch.manual_seed(0)
    model = entry.build()
    batch = entry.make_batch(64, 4)
    assert entry.step_fn is not None
    trace = trace_step(
        model, batch, entry.step_fn, device="cpu", autocast=torch.bfloat16, min_offload_bytes=0
    )
    params = {s.id for s in trace.storages if s.kind == "param"}
    casts = {
        s.id
        for s in trace.storages
        if s.alloc_op >= 0
        and trace.ops[s.alloc_op].name == "aten._to_copy.default"
        and params & set(trace.ops[s.alloc_op].inputs)
    }
    saved = {storage for storage, _, _ in trace.entries()}
    assert casts & saved  # the matrix products save the casts
    assert not casts & trace.held_by_code

    def run(offload: lms.LMS | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with offload or contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16):
            entry.step_fn(model, batch)
        return [p.grad.clone() for p in model.parameters()]

    plain = run(None)
    offload = lms.LMS(budget="70%", min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    offload.tune(model, batch, entry.step_fn, autocast=torch.bfloat16)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(plain, run(offload), strict=True))
    assert offload.stats.offloaded_tensors + offload.stats.recomputed_tensors > 0
    assert offload.stats.diverged_steps == 0


def test_autocast_casts_held_through_backward_are_named_with_the_way_out():
    """Note [Autocast keeps its casts of the weights]: a step whose backward runs inside autocast
    holds the weights' casts, and the report says they are autocast's and what lets them move."""
    import lms

    def step(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        loss = model(batch[0]).float().square().mean()
        loss.backward()  # inside the caller's autocast, its cache still full
        return loss

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])

    report = lms.analyze(
        model, [torch.randn(256, 512)], step, gpu_memory="60%", device_spec="h100",
        autocast=torch.bfloat16, min_offload_bytes=0,
    )  # fmt: skip
    said = "\n".join(report.lines())
    assert "are casts of the weights that autocast keeps until its block ends" in said
    # three 512x512 bfloat16 casts: the first layer's input needs no gradient, so its product
    # saves no weight
    assert "1.50 MiB of what the code holds" in said


def test_a_bench_runs_lms_on_the_heap_the_peers_run_on(monkeypatch, capsys):
    """Note [A bench runs every method on the same heap]: a bench's LMS run leaves glibc's
    allocator setting as it is (``cpu_resident=False``), as every other method runs."""
    import sys

    import lms.harness.train as harness
    from lms.harness.bench import child_main

    made = []
    real = harness.LMS

    def recording(**settings):  # type: ignore[no-untyped-def]
        made.append(settings)
        return real(**settings)

    monkeypatch.setattr(harness, "LMS", recording)
    run = {
        "model": "tests.test_train:volume_segmenter", "size": 12, "batch_size": 1, "steps": 1,
        "method": "lms", "budget": 2**30, "amp": False,
    }  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["bench", json.dumps(run)])
    child_main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"], result
    assert [settings["cpu_resident"] for settings in made] == [False]
