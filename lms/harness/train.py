"""`lms train`: a real training loop over a zoo model, with or without LMS or a peer method.

Methods: ``none`` (plain), ``lms`` (this library, tuned to the budget), ``save_on_cpu``
(`torch.autograd.graph.save_on_cpu`), ``checkpoint`` (non-reentrant activation checkpointing of
every block), ``hf_checkpoint`` (a Hugging Face model's own gradient checkpointing),
``hf_offload`` (the same, its checkpoints' inputs held in host memory: ``offload=True``),
``compile_budget`` (``torch.compile`` whose partitioner recomputes to keep `COMPILE_BUDGET` of
the activations: ``torch._functorch.config.activation_memory_budget``). Memory is the device's
peak allocation on a GPU; on the CPU, the weights, buffers and batch the step starts with plus the
growth of the C heap in use over the step (Note [The C heap in use, not the resident set, measures
a CPU step]), the scope of a budget and of the simulator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from lms.analysis.simulate import simulate
from lms.core import costs
from lms.core.config import Tier
from lms.core.errors import LMSError, step_failed
from lms.core.keep import no_offload_in, submodules
from lms.core.units import check_counts, format_bytes, format_rate, parse_share
from lms.harness.memory import SampledSteps, tensors_bytes
from lms.harness.zoo import ZOO, ZooModel, zoo_model
from lms.orchestration.session import LMS

__all__ = [
    "TrainResult",
    "train",
    "METHODS",
    "checkpoint_blocks",
    "far_from_plan",
    "hugging_face_checkpointing",
]

log = logging.getLogger("lms.harness.train")
METHODS = (
    "none",
    "lms",
    "save_on_cpu",
    "checkpoint",
    "hf_checkpoint",
    "hf_offload",
    "compile_budget",
)
COMPILE_BUDGET = 0.5
"""``activation_memory_budget`` of the "compile_budget" method: the share of the activations
torch.compile's partitioner may keep for backward (0 recomputes all it can, 1 keeps all)."""
_SNAPSHOT_ENTRIES = 200_000
"""Allocator events a memory snapshot keeps: a ResNet50 step makes about 5000."""


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """Measured figures of a training run (steady state: the first step is left out)."""

    model: str
    method: str
    size: int
    batch_size: int
    steps: int
    step_s: float
    """Mean time of the steps after the first; on a CPU with three steps or more, of those
    after the second, whose memory is sampled (Note [Steps timed without the sampler])."""
    samples_per_s: float
    elements_per_s: float
    unit: str
    peak_bytes: int
    """Peak device allocation (GPU); on a CPU, ``start_bytes`` plus the peak growth of the C heap
    in use over a sampled step (the resident set's where the heap is not counted:
    `lms.harness.memory`)."""
    device: str
    loss: float
    lms_stats: dict[str, float] | None
    plan: dict[str, Any] | None = None
    """With LMS tuned: the plan's predicted peak and overhead, and how many storages it moves."""
    rss_growth_bytes: int | None = None
    """On a CPU: the resident set's peak growth over a step, for reference."""
    start_bytes: int | None = None
    """On a CPU: the weights, buffers and batch each step starts with, which a budget counts as a
    GPU's allocation does (optimizer state is not counted, as the trace of a step that does not
    run the optimizer leaves it out)."""


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap each block (a child with children and parameters) in activation checkpointing."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.ModuleList):
            for index, item in enumerate(child):
                child[index] = _Checkpointed(item)
        elif any(True for _ in child.children()) and any(True for _ in child.parameters()):
            setattr(model, name, _Checkpointed(child))
    return model


@contextlib.contextmanager
def _allocator_history(path: str) -> Iterator[None]:
    """Record the CUDA allocator's history while the block runs; write it to ``path`` when the
    block ends, as it ends (a step out of memory included). Python stacks only: writing C++
    ones symbolizes every frame of PyTorch's libraries first, which can take many GiB of host
    memory beside the offloaded data (a process holding 62 GiB of it at 11500 px was killed
    after its last step, where the snapshot is written)."""
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=_SNAPSHOT_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        log.info("[LMS] the CUDA allocator's history of the steps is in %s", path)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def train(
    model_name: str,
    *,
    size: int,
    batch_size: int = 1,
    steps: int = 3,
    method: str = "lms",
    budget: int | str | None = None,
    tier: Tier = "auto",
    host_budget: int | str | None = None,
    amp: bool = False,
    device: str | None = None,
    data: Sequence[torch.Tensor] | None = None,
    progress: bool = True,
    keep_in: Sequence[str] = (),
    free_held: bool = False,
    slabs: bool = True,
    memory_snapshot: str | None = None,
    record: str | None = None,
    cpu_resident: bool = True,
) -> TrainResult:
    """Train ``steps`` steps of a zoo model and measure them. With method "lms", tensors saved
    inside the submodules named in ``keep_in`` ("layer4") stay on the device (`no_offload_in`);
    ``free_held`` and ``slabs`` are `lms.LMSConfig`'s. ``budget`` may be a share of the step's peak
    without offload on this device, as simulated: ``"60%"``. ``memory_snapshot``: a file for the
    CUDA allocator's history of the steps, written when they end or fail (pytorch.org/memory_viz
    opens it, as it opens the simulator's `lms.export_memory_viz`). ``record``: a file for the
    step record of every step (`lms.LMS.record_steps`; `lms replay` reads it), with method
    "lms" and a budget, or method "none" (its trace and op times taken as a plan's would be).
    ``cpu_resident``: `lms.LMSConfig`'s, with method "lms" on a CPU.

    Raises:
        PlanInfeasibleError: with method "lms", before training, when the budget cannot fit.
        ValueError: an unknown method, fewer than one step, a size below 1, a share of the peak
            outside (0%, 100%], a batch below the model's smallest, a name in ``keep_in`` that
            is not one of the model's submodules, or a memory snapshot asked of a device other
            than CUDA.
        StepFailedError: the model's step raised, traced or in its first real step (ResNet50
            at 32 px and batch 1, say: its last batch norm then sees one value per channel).
    """
    if method not in METHODS:
        raise ValueError(f"lms: method={method!r} is not one of {', '.join(METHODS)}")
    check_counts(steps=steps, size=size)
    parse_share(budget)  # a share out of range is refused before any work; tune sets it
    entry: ZooModel = zoo_model(model_name)
    entry.check_batch(batch_size)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = target.type == "cuda"
    if memory_snapshot is not None and not cuda:
        raise ValueError(
            f"lms: memory_snapshot={memory_snapshot!r} records the CUDA allocator; "
            f"this run trains on {target}"
        )
    if record is not None and not (method == "none" or (method == "lms" and budget is not None)):
        raise ValueError(
            f"lms: record={record!r} records a tuned plan's steps (method lms with a budget) or "
            f"plain ones (method none); method {method!r}"
            + (" has no budget to tune for; give one" if method == "lms" else " is neither")
        )
    model, batch = _model_and_batch(entry, method, size, batch_size, data, target)
    kept = no_offload_in(*submodules(model, keep_in)) if method == "lms" else None
    start_bytes = None if cuda else tensors_bytes([*model.parameters(), *model.buffers(), *batch])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    assert entry.step_fn is not None
    step_fn = entry.step_fn
    autocast = torch.bfloat16 if amp else None
    offload: LMS | None = None
    if method == "lms":
        offload = LMS(
            budget=budget,
            tier=tier,
            host_budget=host_budget,
            model=model,
            free_held=free_held,
            slabs=slabs,
            cpu_resident=cpu_resident,
        )
        if budget is not None:
            offload.tune(model, batch, step_fn, autocast=autocast)
        if record is not None:
            offload.record_steps(target)
    plain = (
        _PlainRecord(model, batch, step_fn, target, autocast) if record and not offload else None
    )

    def context() -> Any:
        if plain is not None:
            return plain.step()
        if method == "lms":
            return offload
        if method == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
        return _nothing()

    label = f"{model_name} {size} {method}"
    recording = _allocator_history(memory_snapshot) if memory_snapshot else _nothing()
    if method == "compile_budget":  # compiled at the first step, under the budget's setting
        import torch._functorch.config as functorch_config

        model = torch.compile(model)  # type: ignore[assignment]
        budgeted = functorch_config.patch(activation_memory_budget=COMPILE_BUDGET)
        recording = _both(recording, budgeted)
    run = SampledSteps(steps, cuda)  # Note [Steps timed without the sampler]
    with recording:
        loss, times, peaks = _run_steps(
            steps,
            lambda: step_fn(model, batch),
            optimizer,
            context,
            run,
            target=target,
            autocast=autocast,
            label=label,
            what=f"{model_name}'s first step at size {size}, batch {len(batch[0])},",
            progress=progress,
        )
    memory = run.steady  # on a CPU, the sampled step after the first (else the first)
    if memory is not None:
        peaks.append((start_bytes or 0) + memory.growth_bytes)
    steady = run.steady_times(times)
    step_s = sum(steady) / len(steady)
    result = TrainResult(
        model=model_name,
        method=method,
        size=size,
        batch_size=len(batch[0]),
        steps=steps,
        step_s=step_s,
        samples_per_s=len(batch[0]) / step_s,
        elements_per_s=len(batch[0]) * entry.elements(size) / step_s,
        unit=entry.unit,
        peak_bytes=max(peaks[1:] or peaks),
        device=torch.cuda.get_device_name(target) if cuda else "cpu",
        loss=float(loss.detach().float()),
        lms_stats=offload.stats.as_dict() if offload is not None else None,
        plan=_plan_summary(offload),
        rss_growth_bytes=None if memory is None else memory.rss_growth_bytes,
        start_bytes=start_bytes,
    )
    if record is not None:
        meta = {"model": model_name, "size": size, "batch_size": len(batch[0]), "method": method}
        if plain is not None:
            plain.save(record, meta)
            last = plain.log.steps[-1]
        else:
            assert offload is not None
            saved = offload.step_record(meta)
            saved.save(record)
            last = saved.steps[-1]
        log.info(
            "[LMS] Recorded %d steps to %s (read them with `lms replay`); the recorder's own host "
            "time in the last: %.4f s of %.4f s",
            steps,
            record,
            last.recorder_s,
            last.step_s,
        )
    if offload is not None:
        offload.close()
    if kept is not None:
        kept.remove()
    _log_result(result, memory, entry, caveat=run.timing_caveat(steps))
    return result


class _PlainRecord:
    """Steps without offload, recorded as `lms.LMS.record_steps` records a plan's, beside what a
    plan's record keeps: the trace, and the spec with the op times a tuner would price it at."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: list[torch.Tensor],
        step_fn: Callable[..., Any],
        target: torch.device,
        autocast: torch.dtype | None,
    ):
        from lms.orchestration.tuning import tune_step
        from lms.runtime.steplog import StepLog

        tuned = tune_step(  # glibc's own mmap threshold, as a step without LMS runs under
            model,
            batch,
            step_fn,
            budget_bytes=None,
            min_offload_bytes=0,
            autocast=autocast,
            cpu_resident=False,
        )
        self.trace, self.spec, self.half = tuned.trace, tuned.spec, tuned.half
        self.log = StepLog(target)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One recorded step."""
        self.log.begin(len(self.log.steps) + 1, {})
        try:
            yield
        finally:
            self.log.end({})

    def save(self, path: str, meta: dict[str, Any]) -> None:
        from lms.core.steprecord import StepRecord

        info = {**self.log.meta(), **meta}
        record = StepRecord(self.trace, None, self.spec, self.half, tuple(self.log.steps), info)
        record.save(path)


def _model_and_batch(
    entry: ZooModel,
    method: str,
    size: int,
    batch_size: int,
    data: Sequence[torch.Tensor] | None,
    target: torch.device,
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The model, seeded, on ``target`` (channels-last for images; its blocks checkpointed for
    the "checkpoint" method, by Hugging Face's own for "hf_checkpoint") and the batch it trains
    on."""
    torch.manual_seed(0)
    model = entry.build().to(target)
    fmt = torch.channels_last if entry.unit == "pixels" else None
    if fmt is not None:
        model = model.to(memory_format=fmt)
    if method == "checkpoint":
        model = checkpoint_blocks(model)
    if method in ("hf_checkpoint", "hf_offload"):
        hugging_face_checkpointing(model, entry.name, offload=method == "hf_offload")()
    batch = list(data) if data is not None else list(entry.make_batch(size, batch_size))
    batch = [t.to(target) for t in batch]
    if fmt is not None:
        batch[0] = batch[0].contiguous(memory_format=fmt)
    return model, batch


def hugging_face_checkpointing(
    model: torch.nn.Module, name: str, *, offload: bool
) -> Callable[[], None]:
    """The call that turns on a Hugging Face model's own checkpointing of its layers: each
    recomputed in backward, its inputs held in pinned host memory with ``offload`` (releases of
    `transformers` that have ``activation_checkpointing_enable``; older ones name it
    ``gradient_checkpointing_enable`` and cannot offload). Found without being made, so that a
    bench refuses a method the model cannot take before any run.

    Raises:
        ValueError: the model is not a Hugging Face model, or its release cannot offload.
    """
    method = "hf_offload" if offload else "hf_checkpoint"
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        return functools.partial(enable, offload=offload)
    older = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(older):
        raise ValueError(
            f"lms: method {method} takes a Hugging Face model (gpt2, llama, a builder of one); "
            f"{name} has no activation_checkpointing_enable(); use method checkpoint"
        )
    if offload:
        import transformers

        raise ValueError(
            f"lms: method hf_offload needs a transformers release whose models offer "
            f"activation_checkpointing_enable(offload=True); this one is "
            f"{transformers.__version__}: upgrade it, or use method hf_checkpoint"
        )
    return older  # type: ignore[no-any-return]


def _run_steps(
    steps: int,
    step: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    context: Callable[[], Any],
    run: SampledSteps,
    *,
    target: torch.device,
    autocast: torch.dtype | None,
    label: str,
    what: str,
    progress: bool,
) -> tuple[torch.Tensor, list[float], list[int]]:
    """Run and time ``steps`` steps, each inside ``context()``: the last loss, each step's seconds
    and, on CUDA, each step's allocator peak. A first step that raises names ``what``."""
    cuda = target.type == "cuda"
    times: list[float] = []
    peaks: list[int] = []  # CUDA's, a step each
    loss = torch.zeros(())
    for index in tqdm(range(steps), desc=label, unit="step", disable=not progress):
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(target)
            torch.cuda.reset_peak_memory_stats(target)
        with run.sampling(index):
            start = time.perf_counter()
            mixed = torch.autocast(target.type, dtype=autocast) if autocast else _nothing()
            try:
                with context(), mixed:
                    loss = step()
            except LMSError:
                raise
            except Exception as error:
                if times:  # a later step: not a question of the input
                    raise
                raise step_failed(error, what) from error
            optimizer.step()
            if cuda:
                torch.cuda.synchronize(target)
            times.append(time.perf_counter() - start)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(target))
    return loss, times, peaks


FAR_FROM_PLAN = 2.0
"""How many times slower or faster than its plan predicted a step must run for `lms train` to
say where the prediction's op times came from."""


def far_from_plan(measured_s: float, predicted_s: float) -> str | None:
    """What to do about a step that ran `FAR_FROM_PLAN` times slower or faster than its plan
    predicted; None for one nearer. The plan is priced at its ops' times as they were measured
    when it was tuned, and the plan cache keeps those times with the plan for later runs: timed
    while the machine was busy, they price every later run of the step wrong."""
    if measured_s <= 0 or predicted_s <= 0:
        return None
    ratio = measured_s / predicted_s
    if 1 / FAR_FROM_PLAN < ratio < FAR_FROM_PLAN:
        return None
    from lms.orchestration.cache import ENV_VAR, cache_folder

    return (
        f"[LMS] The step ran {ratio:.2f}x the time its plan predicted. The plan is priced at "
        "its ops' times as measured when it was tuned, in this run or in an earlier one whose "
        f"plan the cache kept ({cache_folder()}); if the machine was busier or quieter then, "
        f"delete this step's files there (or set {ENV_VAR} to an empty folder) to time them again"
    )


def _log_result(result: TrainResult, memory: Any, entry: ZooModel, *, caveat: str = "") -> None:
    """The run's `[LMS]` line: its step time, rate and peak, and on a CPU where the peak came
    from (weights and batch, then the heap's or the resident set's growth)."""
    start_bytes = result.start_bytes
    measure = ""
    if start_bytes is not None and memory is not None:
        grew = f"grew by {format_bytes(result.peak_bytes - start_bytes)}"
        if memory.heap_growth_bytes is None:  # the resident set is all there is
            grew = f"the resident set {grew}"
        else:
            grew = f"the heap in use {grew} ({format_bytes(result.rss_growth_bytes or 0)} resident)"
        measure = f": {format_bytes(start_bytes)} of weights and batch, then {grew}"
    log.info(
        "[LMS] %s %s batch %d, %s: %.3f s/step, %.3g samples/s, %s, peak %s%s",
        result.model,
        entry.sized(result.size),
        result.batch_size,
        result.method,
        result.step_s,
        result.samples_per_s,
        format_rate(result.elements_per_s, entry.unit),
        format_bytes(result.peak_bytes),
        measure,
    )
    plan = result.plan
    if plan is not None and "base_step_s" in plan:
        log.info(
            "[LMS] The plan predicted %.4f s a step (%+.1f%% over a no-offload step of %.4f s "
            "at the op times and rates it was priced on; floor %.4f s, the larger of that and "
            "the link's time for the bytes it moves); measured %.4f s, %.2fx the floor%s",
            plan["predicted_step_s"],
            100 * plan["predicted_overhead"],
            plan["base_step_s"],
            plan["floor_s"],
            result.step_s,
            result.step_s / plan["floor_s"] if plan["floor_s"] else float("nan"),
            f" ({caveat})" if caveat else "",
        )
        advice = None if caveat else far_from_plan(result.step_s, plan["predicted_step_s"])
        if advice is not None:  # not for a first or sampled step, whose time says less
            log.warning(advice)


def _plan_summary(offload: LMS | None) -> dict[str, Any] | None:
    if offload is None or offload.plan is None:
        return None
    plan = offload.plan
    summary = {
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_overhead": plan.predicted_overhead,
        "budget_bytes": plan.budget_bytes,
        "offload": len(plan.offload),
        "recompute": len(plan.recompute),
        "refetch": len(plan.refetch),
        "spill": len(plan.spill),
        "relieved_junctions": len(plan.relieved_junctions),
        "free_held": len(plan.free_held),
        "slabs": dict(plan.slabs),
        "entries": plan.num_entries,
    }
    if offload.priced_on is not None:  # the no-offload step the plan was priced against
        trace, spec, half = offload.priced_on
        planned = simulate(trace, plan, spec, half=half)
        summary["base_step_s"] = planned.base_step_s
        summary["predicted_step_s"] = planned.step_s
        summary["floor_s"] = costs.floor_s(spec, planned.offloaded_bytes, planned.base_step_s)
    return summary


def load_images(folder: str, model: str, size: int, batch_size: int) -> list[torch.Tensor]:
    """One batch for ``model`` from a folder of images (a subfolder a class), resized to ``size``.

    Raises:
        ValueError: the model does not classify images, the folder holds no classes of images,
            or fewer images than ``batch_size``.
    """
    from torchvision import datasets, transforms

    entry = zoo_model(model)
    if not entry.classifies_images:
        classifiers = ", ".join(name for name, known in ZOO.items() if known.classifies_images)
        raise ValueError(
            f"lms: --data feeds image classifiers ({classifiers} or a builder of your own); "
            f"{model} takes {entry.unit}, so train it on its synthetic batches"
        )
    try:
        dataset = datasets.ImageFolder(
            folder, transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor()])
        )
    except (FileNotFoundError, NotADirectoryError) as error:
        raise ValueError(
            f"lms: --data {folder}: {str(error).rstrip('.')}; give a folder with one subfolder "
            "of images a class"
        ) from None
    if len(dataset) < batch_size:
        raise ValueError(
            f"lms: --data {folder} holds {len(dataset)} images, fewer than the batch size "
            f"{batch_size}; add images or lower --batch-size"
        )
    order = torch.randperm(len(dataset))[:batch_size].tolist()
    samples = []
    for index in order:
        path = dataset.samples[index][0]
        try:
            samples.append(dataset[index])
        except (OSError, ValueError, SyntaxError) as error:  # PIL's errors for a bad image
            raise ValueError(
                f"lms: --data image {path!r} cannot be read ({type(error).__name__}: "
                f"{str(error).rstrip('.')}); remove or replace it"
            ) from None
    images = torch.stack([image for image, _ in samples])
    labels = torch.tensor([label for _, label in samples])
    return [images, labels]
