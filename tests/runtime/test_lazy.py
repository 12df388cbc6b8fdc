"""Lazy modules train under LMS as they do without it; a trace refuses them before they have made
their parameters, and leaves them as they were."""

import pytest
import torch

import lms
from tests.conftest import assert_bitwise, run_step

pytestmark = pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")


def _lazy():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.LazyLinear(64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.LazyLinear(8)
    )


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "model="])
def test_lazy_modules_train_bitwise_with_everything_offloaded(spill_dir, named):
    inputs = (torch.randn(16, 32),)
    plain = run_step(_lazy(), inputs)
    model = _lazy()
    offload = lms.LMS(
        tier="disk",
        spill_dir=spill_dir,
        swapout_threshold=1,
        min_offload_bytes=1,
        model=model if named else None,
    )
    assert_bitwise(plain, run_step(model, inputs, offload))  # the first step makes them
    assert offload.stats.offloaded_tensors > 0
    assert_bitwise(run_step(_lazy_made(inputs), inputs), run_step(model, inputs, offload))


def _lazy_made(inputs):
    model = _lazy()
    run_step(model, inputs)
    return model


def test_tune_refuses_a_lazy_model_before_its_first_step_and_leaves_it_lazy():
    model = _lazy()
    inputs = (torch.randn(16, 32),)
    offload = lms.LMS(budget="64KiB", tier="disk")
    with pytest.raises(lms.UnplannableStepError, match=r"Sequential\.0 \(LazyLinear\).*run one"):
        offload.tune(model, inputs, lambda m, b: m(*b).square().mean())
    assert isinstance(model[0], torch.nn.LazyLinear) and model[0].has_uninitialized_params()
    assert_bitwise(run_step(_lazy(), inputs), run_step(model, inputs))
