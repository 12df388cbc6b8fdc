"""The Lightning callback: a tuned plan followed in `Trainer.fit`, bitwise, and nothing left."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("lightning")  # a dev dependency; a machine without it skips these

from lightning.pytorch import LightningModule, Trainer  # noqa: E402

import lms  # noqa: E402
from lms.analysis import device_spec, trace_step  # noqa: E402
from lms.integrations.lightning import LMSCallback  # noqa: E402
from tests.conftest import (  # noqa: E402
    assert_followed,
    hooks_are_gone,
    midway_budget,
    same_bits,
    spill_files,
)


class Images(Dataset):
    """Dict batches, so the tuner traces the batch structure Lightning hands the step."""

    def __init__(self, count=8, edge=64):
        generator = torch.Generator().manual_seed(1)
        self.images = torch.randn(count, 3, edge, edge, generator=generator)
        self.labels = torch.randint(0, 10, (count,), generator=generator)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"image": self.images[i], "label": self.labels[i]}


class Net(LightningModule):
    def __init__(self, fail_at=None, ctrl_c=False):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.Tanh(),
        )
        self.head = nn.Linear(16, 10)
        self.fail_at = fail_at
        self.ctrl_c = ctrl_c

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["image"]), batch["label"])
        if batch_idx == self.fail_at and self.ctrl_c:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: Lightning shuts down and exits 1
        if batch_idx == self.fail_at:
            raise RuntimeError("failed mid-step")
        self.log("loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(callbacks, model=None, precision="32-true", accelerator="cpu", edge=64, accumulate=1):
    torch.manual_seed(0)
    model = model or Net()
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,
        accumulate_grad_batches=accumulate,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(Images(edge=edge), batch_size=2))
    return model


def assert_same_state(plain, other):
    """Every weight and buffer of ``other`` has the bits of ``plain``'s; a failure names the
    first that differs, by how much, and the intra-op threads this process ran with."""
    theirs = other.state_dict()
    assert list(theirs) == list(plain.state_dict())
    for name, a in plain.state_dict().items():
        b = theirs[name]
        assert same_bits(a, b), (
            f"{name} differs by up to {(a.double() - b.double()).abs().max().item():.3g} "
            f"({torch.get_num_threads()} threads)"
        )


def midway(precision):
    """A budget for `fit` halfway between its step's floor and peak on this machine: what a
    convolution takes while it runs depends on the kernel the CPU gets (in bf16 more than twice
    as much where the CPU lacks the instructions oneDNN uses)."""
    images = Images()
    batch = [images.images[:2], images.labels[:2]]

    def step(model, batch):
        F.cross_entropy(model(batch[0]), batch[1]).backward()

    torch.manual_seed(0)
    amp = torch.bfloat16 if precision == "bf16-mixed" else None
    trace = trace_step(Net(), batch, step, device="cpu", autocast=amp, min_offload_bytes=0)
    return midway_budget(trace, device_spec("cpu"))


@pytest.mark.parametrize(
    ("precision", "accumulate"), [("32-true", 1), ("bf16-mixed", 1), ("32-true", 2)]
)
def test_fit_follows_the_tuned_plan_bitwise(tmp_path, caplog, precision, accumulate):
    caplog.set_level("INFO", logger="lms")
    plain = fit([], precision=precision, accumulate=accumulate)
    spill = tmp_path / "spill"
    spill.mkdir()
    callback = LMSCallback(
        budget=midway(precision), min_offload_bytes=0, spill_dir=str(spill), cache_dir=str(tmp_path)
    )
    offloaded = fit([callback], precision=precision, accumulate=accumulate)
    assert_same_state(plain, offloaded)
    plan = callback.lms.plan
    assert plan is not None  # tuned on the first batch
    batches = 3 * accumulate  # one LMS step a batch; the optimizer steps every `accumulate`
    assert callback.lms.stats.steps == batches
    assert_followed(plan, callback.lms.stats, steps=batches)  # spilled or replayed, by the rates
    assert "falling back" not in caplog.text
    assert spill_files(str(spill)) == []
    assert hooks_are_gone()


def test_named_submodules_stay_on_the_device_during_fit_only(tmp_path, caplog):
    caplog.set_level("INFO", logger="lms")
    plain = fit([])
    spill = tmp_path / "spill"
    spill.mkdir()
    settings = dict(budget="3.5MiB", min_offload_bytes=0, spill_dir=str(spill))
    callbacks = [
        LMSCallback(cache_dir=str(tmp_path), **settings),
        LMSCallback(
            no_offload_in=["features.3", "features.4"], cache_dir=str(tmp_path), **settings
        ),
    ]
    models = [fit([callback]) for callback in callbacks]
    assert_same_state(plain, models[1])
    kept = [callback.lms.stats.kept_tensors for callback in callbacks]
    assert kept[1] > kept[0]  # what features.3 and .4 save
    assert "falling back" not in caplog.text
    assert not models[1].features[3]._forward_pre_hooks and hooks_are_gone()
    with pytest.raises(ValueError, match="no submodule 'features.9'"):
        fit([LMSCallback(no_offload_in=["features.9"], **settings)])


def test_an_untuned_fit_runs_no_hook_on_every_module_call(tmp_path):
    from torch.nn.modules import module

    plain = fit([])
    torch.manual_seed(0)
    net, hooked = Net(), []
    net.features[0].register_forward_pre_hook(
        lambda *_: hooked.append(bool(module._global_forward_pre_hooks))
    )
    callback = LMSCallback(tune=False, budget="2MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    fit([callback], net)
    assert_same_state(plain, net)
    assert callback.lms.plan is None and callback.lms.stats.offloaded_tensors > 0
    assert hooked and not any(hooked)  # the module's parameters are known from the start


def test_infeasible_budget_fails_before_the_first_step(tmp_path):
    torch.manual_seed(0)
    model = Net()
    before = [p.clone() for p in model.parameters()]
    callback = LMSCallback(budget="1KiB", spill_dir=str(tmp_path), cache_dir=str(tmp_path))
    with pytest.raises(lms.PlanInfeasibleError, match="below"):
        fit([callback], model)
    assert all(same_bits(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert hooks_are_gone()


def test_exception_mid_step_leaves_nothing(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    callback = LMSCallback(
        budget="3MiB", min_offload_bytes=0, spill_dir=str(spill), cache_dir=str(tmp_path)
    )
    with pytest.raises(RuntimeError, match="failed mid-step"):
        fit([callback], Net(fail_at=1))
    assert callback.lms.stats.offloaded_tensors > 0  # the failing step had moved tensors out
    assert spill_files(str(spill)) == []
    assert hooks_are_gone()


def test_ctrl_c_mid_fit_leaves_no_spill_files(tmp_path):
    # In a subprocess: Lightning ignores SIGINT for the rest of a process it shut down. A shell
    # starts a background job ignoring SIGINT, and Python then raises no KeyboardInterrupt.
    script = f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from tests.integrations.test_lightning import LMSCallback, Net, fit
        net = Net(fail_at=1, ctrl_c=True)
        fit([LMSCallback(budget="3MiB", min_offload_bytes=0, spill_dir={str(tmp_path)!r},
                         cache_dir={str(tmp_path / "plans")!r})], net)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "KeyboardInterrupt" in done.stderr
    assert [f for f in spill_files(str(tmp_path)) if "plans" not in f] == []


def test_bad_settings_fail_when_the_callback_is_made():
    with pytest.raises(ValueError, match="sync_mode"):
        LMSCallback(sync_mode=7)


class ManualNet(Net):
    """Manual optimization (a GAN's two updates a batch takes it): the callback traces none."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["image"]), batch["label"])
        self.manual_backward(loss)
        self.optimizers().step()


def test_a_share_of_the_peak_with_no_trace_to_tell_it_is_refused_before_fit(tmp_path):
    """The runtime refused such a budget at the first batch, asking for tune(), which the
    callback does not call with manual optimization or ``tune=False``."""
    with pytest.raises(ValueError, match=r"tune=False\) traces nothing; give the budget as a size"):
        LMSCallback(budget="60%", tune=False)
    model = ManualNet()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="manual optimization; give the budget as a size"):
        fit([LMSCallback(budget="60%", cache_dir=str(tmp_path))], model)
    assert all(same_bits(a, b) for a, b in zip(before, model.parameters(), strict=True))
    callback = LMSCallback(budget="3MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    fit([callback], ManualNet())
    assert callback.lms.stats.offloaded_tensors > 0 and hooks_are_gone()


def test_import_lms_leaves_the_frameworks_unimported():
    probe = "import sys, lms; print(sorted({m.split('.')[0] for m in sys.modules}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    for framework in ("lightning", "pytorch_lightning", "torchvision", "monai", "matplotlib"):
        assert f"'{framework}'" not in done.stdout
