"""Typed errors. Each message says what failed, gives the numbers, and ends with what to do."""

from __future__ import annotations

import traceback

__all__ = [
    "LMSError",
    "SpillError",
    "HostMemoryError",
    "PlanInfeasibleError",
    "SavedTensorChangedError",
    "StepAbortedError",
    "StepFailedError",
    "StepStateError",
    "UnplannableStepError",
]


class LMSError(RuntimeError):
    """Base class of every error the library raises on purpose."""


class SpillError(LMSError):
    """The spill directory cannot be used: not writable, or the disk is full."""


class HostMemoryError(LMSError):
    """Offloaded data does not fit in the host memory allowed for it."""


class StepAbortedError(LMSError):
    """Backward asked for a tensor whose offloaded copy was discarded when its step failed."""


class SavedTensorChangedError(LMSError):
    """An in-place op changed a tensor after autograd saved it for backward (autograd raises
    the same without LMS)."""


class PlanInfeasibleError(LMSError):
    """No plan fits the budget: names the operation that cannot fit and the smallest budget;
    ``op_module``: the module of the operation at that smallest budget's peak."""

    def __init__(
        self,
        message: str,
        *,
        op_name: str,
        op_bytes: int,
        min_budget_bytes: int,
        op_module: str = "",
    ):
        super().__init__(message)
        self.op_name = op_name
        self.op_module = op_module
        self.op_bytes = op_bytes
        self.min_budget_bytes = min_budget_bytes


class StepFailedError(LMSError):
    """The training step itself raised: traced under fake tensors, or run for the first time.

    The step's own exception is the ``__cause__``; ``where`` is the file, line and function that
    raised it.
    """

    def __init__(self, message: str, *, where: str):
        super().__init__(message)
        self.where = where


class StepStateError(LMSError):
    """The traced step left fake tensors in objects outside the trace: state it made lazily
    while it ran under fake tensors (a `GradScaler`'s scale, a tensor an object outside the model
    keeps; what the model's own modules keep is put back).
    ``holders`` names where each was found."""

    def __init__(self, message: str, *, holders: list[str]):
        super().__init__(message)
        self.holders = holders


class UnplannableStepError(LMSError):
    """The traced step is not one forward and backward: it runs forward again after its
    backward finished (gradient accumulation over micro-batches, or a GAN's two models, in one
    step), where a plan names saved tensors by their order in one forward and backward; or it
    saves tensors and runs no backward at all; or the model's parameters are split across
    processes by tensor parallelism (DTensors that flow through forward), which fake tensors
    cannot trace. FSDP2's (`fully_shard`) are traced whole (Note [FSDP2's layers traced whole])."""


def step_failed(error: BaseException, what: str) -> StepFailedError:
    """A `StepFailedError` for ``error`` raised by ``what`` (say, "ResNet50's step under fake
    tensors"), naming the exception and the frame that raised it."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    hint = "fix the model, its input or the step function"
    if type(error).__module__.startswith("torch._subclasses"):
        # Fake tensors carry no values: the trace computes those of the batch and the weights
        # (Note [A value the step reads is computed for real]), not of the activations.
        hint = (
            "the step cannot be traced: an op's output depends on the data, here on values the "
            "trace does not compute (of activations, or of weights a builder made); run lms.LMS "
            "without tune (its runtime policy needs no trace) or with a plan made by hand"
        )
    return StepFailedError(
        f"lms: {what} raised {type(error).__name__}: {error} (at {where}); {hint}", where=where
    )
