"""Hugging Face `transformers.Trainer` integration.

``offload_trainer(trainer, budget=...)`` runs each micro-batch's forward, loss and backward
(`Trainer.training_step`) in one `lms.LMS` block, so gradient accumulation gets one block per
micro-batch as the runtime expects. With ``tune=True`` the first micro-batch of each shape is
traced under fake tensors and planned before it runs (Note [A plan for each shape of batch]), so
a budget no plan fits fails before any weight changes.

Nothing of `transformers` is imported here: the trainer is taken as it is, and only its
``training_step`` is wrapped, inside a ``with`` block, so an exception mid-step leaves no hooks
behind.
"""

from __future__ import annotations

import functools
from typing import Any

from lms.orchestration.session import LMS

__all__ = ["offload_trainer"]


def offload_trainer(
    trainer: Any,
    *,
    budget: int | str | None = None,
    tune: bool = True,
    cache_dir: str | None = None,
    **settings: Any,
) -> LMS:
    """Offload the saved activations of every training micro-batch of ``trainer``.

    Args:
        trainer: a `transformers.Trainer` (or a subclass); its ``training_step`` is wrapped in
            place. Wrapping one trainer twice is refused.
        budget: device memory for each micro-batch's step (``"30GiB"``), as for `lms.LMS`.
        tune: trace and plan the first micro-batch of each shape before it runs; set False for
            models that fake tensors cannot trace (sharded parameters), whose runtime policy
            then keeps the newest saved tensors within the budget.
        cache_dir: where tuned plans are cached (default ``$LMS_CACHE_DIR``, else
            ``~/.cache/lms/plans``).
        **settings: any other `lms.LMS` setting (``tier``, ``min_offload_bytes``, ...).

    Returns:
        The `lms.LMS` object the steps run in: its ``stats`` and ``plan`` after training.

    Raises:
        TypeError: ``trainer`` has no ``training_step``.
        ValueError: ``trainer`` is wrapped already, a setting is out of range, or with
            ``tune=False`` the budget is a share of the peak (``"60%"``).
    """
    step = getattr(trainer, "training_step", None)
    if not callable(step):
        raise TypeError(
            f"lms: offload_trainer takes a transformers.Trainer, not {type(trainer).__name__}"
        )
    if getattr(step, "__lms__", None) is not None:
        raise ValueError("lms: this trainer's steps run under LMS already; wrap it once")
    offload = LMS(budget=budget, **settings)
    if not tune:
        offload.config.refuse_share("offload_trainer(tune=False) traces nothing")

    @functools.wraps(step)
    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if tune:  # each batch shape once (Note [A plan for each shape of batch])
            offload.tune(
                model,
                inputs,
                lambda traced, batch: step(traced, batch, *args, **kwargs),
                cache_dir=cache_dir,
            )
        with offload:
            return step(model, inputs, *args, **kwargs)

    training_step.__lms__ = offload  # type: ignore[attr-defined]
    trainer.training_step = training_step
    return offload
