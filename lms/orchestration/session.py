"""`lms.LMS`: the runtime (`lms.runtime.session.Session`) with its planning, `tune`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import Unpack

from lms.analysis.trace import batch_shape
from lms.core.config import LMSConfig, LMSSettings
from lms.core.errors import PlanInfeasibleError
from lms.core.plan import Plan
from lms.orchestration.tuning import tune_step
from lms.runtime.session import Session

__all__ = ["LMS", "SHAPES_KEPT"]

log = logging.getLogger("lms")

SHAPES_KEPT = 16
"""Batch shapes whose plans one `LMS` keeps for `LMS.tune` (Note [A plan for each shape of
batch]); a batch of a further shape is not tuned, and its steps follow the budget's own policy."""


# Note: [A plan for each shape of batch]
# A plan is made for one step's tensors, by their order and size, so a batch of another shape (a
# language model's batches padded to each batch's longest sequence) leaves it at its first larger
# save and follows the budget's own policy. `LMS.tune` keeps each plan it makes by the batch's
# shape (`lms.analysis.trace.batch_shape`: its tensors' shapes, strides, dtypes and devices, how
# they nest and share storages), the model, the step function's code and the autocast dtype. A
# batch of a shape tuned before takes its plan back at once, without tracing; one of a new shape
# is traced and planned within the same budget in bytes (a share such as ``"60%"`` is of the
# first batch's peak: the device memory the run may take); a function that makes the batch is
# traced each time. Where no plan fits a later shape, its steps follow the budget's own policy,
# as a step that leaves its plan does: training that ran goes on. The Trainer hook and the
# Lightning callback call `tune` before each batch. Each plan holds its trace, so `SHAPES_KEPT`
# of them are kept at most: batches of many lengths are better padded to a few
# (``pad_to_multiple_of``).


class LMS(Session):
    """Offload saved activations of a training step to host memory or disk, and bring them back.

    Use one object for the whole run and one ``with`` block per step: it records the first step
    and decides at save time from the second on, and it reuses its host buffers.

    Example::

        offload = lms.LMS(budget="10GiB")
        for x, y in loader:
            with offload:
                loss = loss_fn(model(x), y)
                loss.backward()
            optimizer.step()

    Args are those of `lms.LMSConfig` (all keyword-only); ``config`` passes a ready one instead.
    ``model`` (a module or several) names the models the steps run: their parameters and buffers
    stay, known from the start (`tune` notes its model too). Without it, a hook on every module
    call finds them, which splits a model compiled in place into more graphs.

    Attributes:
        stats: what the runtime moved and what it cost (`lms.LMSStats`), over every step.
        config: the settings (`lms.LMSConfig`).
    """

    def __init__(
        self,
        *,
        config: LMSConfig | None = None,
        plan: Plan | None = None,
        model: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
        **settings: Unpack[LMSSettings],
    ):
        super().__init__(config=config, plan=plan, model=model, **settings)
        self._shapes: dict[tuple[Any, ...], tuple[Plan, Any] | None] = {}
        """Each plan `tune` made and what it was priced on, by the shape of its batch; None for
        a shape no plan fits (Note [A plan for each shape of batch])."""
        self._shapes_said = False

    def tune(
        self,
        model: torch.nn.Module,
        batch: Any,
        step_fn: Any = None,
        *,
        autocast: torch.dtype | None = None,
        cache_dir: str | None = None,
    ) -> Plan | None:
        """Plan before the first step: trace ``step_fn(model, batch)`` with fake tensors, plan it
        for this device and budget, and follow the plan from then on.

        Call it again before a step whose batch has another shape: each shape gets a plan of its
        own within the same budget (a share is turned into bytes at the first call), and a shape
        tuned before takes its plan back without tracing (Note [A plan for each shape of batch]).
        Where no plan fits a later shape, or `SHAPES_KEPT` shapes have plans already, it returns
        None, warns, and that shape's steps follow the budget's own policy.

        Raises:
            PlanInfeasibleError: at the first call, when no plan fits the budget.
            HostMemoryError: with tier "host", when the offloaded data cannot fit in host memory.
            SpillError: when the spill files the plan needs do not fit on the spill disk.
        """
        param = next(model.parameters(), None)
        weights = (param.dtype, param.device) if param is not None else None
        code = getattr(step_fn, "__code__", step_fn)
        # a function that makes the batch is traced each time: its shape is not known before
        shape = None if callable(batch) else batch_shape(batch)
        key = (id(model), model.training, weights, code, autocast, shape)
        if shape is not None and key in self._shapes:
            kept = self._shapes[key]
            if kept is None:
                self.plan = None
                return None
            return self.adopt(kept[0], priced_on=kept[1], model=model)
        if shape is not None and len(self._shapes) >= SHAPES_KEPT:
            if not self._shapes_said:
                self._shapes_said = True
                log.warning(
                    "[LMS] plans for %d batch shapes are kept already; steps of other shapes "
                    "follow the budget's own policy (pad batches to fewer shapes)",
                    SHAPES_KEPT,
                )
            self.plan = None
            return None
        try:
            tuned = tune_step(
                model,
                batch,
                step_fn,
                budget_bytes=self.config.budget_bytes,
                min_offload_bytes=self.config.min_offload,
                autocast=autocast,
                cache_dir=cache_dir,
                tier=self.config.tier,
                host_budget_bytes=self.host_limit_bytes,
                spill_dir=self.config.spill_dir,
                free_held=self.config.free_held,
                slabs=self.config.slabs,
                cpu_resident=self.config.cpu_resident,
                budget_share=self.config.budget_share,
            )
        except PlanInfeasibleError as error:
            if not self._shapes:  # the first batch: before any training
                raise
            log.warning(
                "[LMS] a batch of another shape: %s; steps of this shape follow the budget's "
                "own policy",
                error,
            )
            if shape is not None:
                self._shapes[key] = None
            self.plan = None
            return None
        if self.config.budget_share is not None:  # the share is now a size: the tune's
            self.config = dataclasses.replace(self.config, budget=tuned.budget)
        priced_on = (tuned.trace, tuned.spec, tuned.half)
        if shape is not None:
            self._shapes[key] = (tuned.plan, priced_on)
        return self.adopt(tuned.plan, priced_on=priced_on, model=model)
