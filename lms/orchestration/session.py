"""`lms.LMS`: the runtime (`lms.runtime.session.Session`) with its planning, `tune`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lms.core.plan import Plan
from lms.orchestration.tuning import tune_step
from lms.runtime.session import Session

__all__ = ["LMS"]


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

    def tune(
        self,
        model: torch.nn.Module,
        batch: Any,
        step_fn: Any = None,
        *,
        autocast: torch.dtype | None = None,
        cache_dir: str | None = None,
    ) -> Plan:
        """Plan before the first step: trace ``step_fn(model, batch)`` with fake tensors, plan it
        for this device and budget, and follow the plan from then on.

        Raises:
            PlanInfeasibleError: before any training, when no plan fits the budget.
            HostMemoryError: with tier "host", when the offloaded data cannot fit in host memory.
            SpillError: when the spill files the plan needs do not fit on the spill disk.
        """
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
        if self.config.budget_share is not None:  # the share is now a size: the plan's
            self.config = dataclasses.replace(self.config, budget=tuned.plan.budget_bytes)
        return self.adopt(tuned.plan, priced_on=(tuned.trace, tuned.spec, tuned.half), model=model)
