"""`LMSCallback`: Large Model Support for a Lightning ``Trainer``, one line.

    trainer = lightning.pytorch.Trainer(callbacks=[LMSCallback(budget="30GiB")])

Each training batch (forward, loss, backward) runs in one `lms.LMS` block. With ``tune=True`` the
first batch of each shape is traced with fake tensors and planned before it trains (Note [A plan
for each shape of batch]), so a budget that no plan fits raises `lms.PlanInfeasibleError` before
any weight changes. Lightning is imported here only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the older standalone package
    from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[assignment]

from lms.core.config import LMSConfig
from lms.core.keep import NoOffloadIn, no_offload_in, submodules
from lms.core.plan import Plan
from lms.orchestration.session import LMS

__all__ = ["LMSCallback"]

log = logging.getLogger("lms.integrations")

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class LMSCallback(Callback):
    """Offload saved activations of every training batch, following a tuned plan.

    Args:
        tune: trace and plan the first training batch of each shape before it runs (automatic
            optimization only; with manual optimization the runtime's own policy decides, and
            the budget must be a size: a share of the peak, such as ``"60%"``, is refused when
            fit starts, as it is here with ``tune=False``).
        cache_dir: where tuned plans are cached (default ``$LMS_CACHE_DIR``, else
            ``~/.cache/lms/plans``).
        plan: follow this plan instead of tuning one.
        no_offload_in: names of the LightningModule's submodules ("model.layer4") whose saved
            tensors stay on the device (`lms.no_offload_in`), for the fit only.
        **settings: `lms.LMS` settings: ``budget``, ``tier``, ``sync_mode``, ``spill_dir``, ...

    Attributes:
        lms: the `lms.LMS` of the current fit (its ``stats`` and ``plan``), None outside fit.
    """

    def __init__(
        self,
        *,
        tune: bool = True,
        cache_dir: str | None = None,
        plan: Plan | None = None,
        no_offload_in: Sequence[str] = (),
        **settings: Any,
    ):
        super().__init__()
        self.config = LMSConfig(**settings)  # checked now, not at the first batch
        self.plan = plan
        self.tune = tune and plan is None
        if not tune and plan is None:
            self.config.refuse_share("LMSCallback(tune=False) traces nothing")
        self.cache_dir = cache_dir
        self.no_offload_in = tuple(no_offload_in)
        self.lms: LMS | None = None
        self._open = False
        self._kept: NoOffloadIn | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            submodules(pl_module, self.no_offload_in)  # a wrong name fails before fit
            if self.tune and not pl_module.automatic_optimization:
                self.config.refuse_share(
                    "the callback traces no step of a LightningModule with manual optimization"
                )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The strategy has put the model on its device: its parameters' storages are final.
        self.lms = LMS(config=self.config, plan=self.plan, model=pl_module)
        self._kept = no_offload_in(*submodules(pl_module, self.no_offload_in))

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.lms is not None, "on_fit_start() makes the LMS object"
        if self.tune:  # each batch shape is tuned once (Note [A plan for each shape of batch])
            self._tune(trainer, pl_module, batch, batch_idx)
        self.lms.__enter__()
        self._open = True

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._close(None)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._close(exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.lms is None:
            return
        self._close(None)
        if self._kept is not None:
            self._kept.remove()
            self._kept = None
        log.info("[LMS] fit ended: %s", self.lms.stats)
        self.lms.close()

    def _close(self, exception: BaseException | None) -> None:
        if self._open and self.lms is not None:
            self._open = False
            error = type(exception) if exception is not None else None
            self.lms.__exit__(error, exception, None)

    def _tune(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.lms is not None
        if not pl_module.automatic_optimization:
            log.info(
                "[LMS] manual optimization: not tuned; the runtime's own policy decides "
                "what to offload"
            )
            self.tune = False
            return

        def step(module: torch.nn.Module, fake_batch: Any) -> torch.Tensor:
            with _quiet(pl_module):
                out = module.training_step(fake_batch, batch_idx)  # type: ignore[operator]
            loss = out["loss"] if isinstance(out, Mapping) else out
            loss.backward()
            return loss

        self.lms.tune(
            pl_module,
            batch,
            step,
            autocast=_AUTOCAST.get(str(trainer.precision)),
            cache_dir=self.cache_dir,
        )


@contextlib.contextmanager
def _quiet(module: LightningModule) -> Iterator[None]:
    """While tracing, ``self.log`` calls keep fake values out of the trainer's logged results."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = ignore  # type: ignore[method-assign]
    module.log_dict = ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
