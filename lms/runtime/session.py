"""`lms.LMS`'s runtime: saved-tensor hooks that move activations out and bring them back.

One ``with`` block is one training step. Backward may run inside the block or after it.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import Self, Unpack

from lms.core import policy
from lms.core.config import LMSConfig, LMSSettings
from lms.core.devices import MAPPED_ALONE_BYTES, DeviceSpec
from lms.core.errors import LMSError
from lms.core.junctions import in_backward
from lms.core.keep import (
    Keep,
    distinct_storages,
    is_weight,
    leave_modules,
    no_offload,
    no_offload_in,
    offload_blocked,
    wrapped_parts,
)
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.core.slabs import split_modules
from lms.core.steprecord import StepRecord
from lms.core.sync import SyncMode
from lms.core.units import format_bytes
from lms.runtime._cuda import allocator_now
from lms.runtime.follow import Follow
from lms.runtime.heap import release_freed_memory
from lms.runtime.pool import available_host_bytes
from lms.runtime.recompute import Replays
from lms.runtime.relief import Relief
from lms.runtime.stats import LMSStats
from lms.runtime.step import Handle, Kept, Step, Wrapped, storage_bytes
from lms.runtime.steplog import StepLog
from lms.runtime.store import Entry, Offloader

__all__ = ["Session", "no_offload", "no_offload_in"]

log = logging.getLogger("lms.runtime")


def _slot(storage: torch.UntypedStorage) -> tuple[str, int]:
    """Where ``storage`` is: its key in the runtime's maps of storages (a freed storage's
    address may name another later, so each map checks a weak reference beside it)."""
    return str(storage.device), storage.data_ptr()


# Long by design: the context manager's public surface (settings, hooks, tune, close, stats)
# in one class; the work is in `follow`, `step`, `store`, `recompute` and `relief`.
class Session:
    """The runtime of `lms.LMS`, without its planning (`lms.LMS.tune`, a layer above): the
    saved-tensor hooks, the stores and the step's state. `lms.LMS` documents its use.

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
        if config is not None and settings:
            raise ValueError("lms: pass either config= or settings, not both")
        self._follow = Follow(config if config is not None else LMSConfig(**settings), plan)
        if plan is not None and plan.spill and self.config.tier == "host":
            raise ValueError(
                f"lms: the plan sends {len(plan.spill)} tensors to spill files but tier='host'; "
                "use tier='auto', or tune with tier='host' for a plan that stays in host memory"
            )
        if plan is not None and plan.free_held and not self.config.free_held:
            raise ValueError(
                f"lms: the plan empties {len(plan.free_held)} tensors the step's code holds "
                "(Plan.free_held) but free_held is off; pass free_held=True, or a plan made "
                "without it"
            )
        host_limit = self.config.host_budget
        if host_limit is None:
            host_limit = available_host_bytes() // 2
        self._offloader = Offloader(
            tier=self.config.tier,
            host_limit_bytes=int(host_limit),
            spill_dir=self.config.spill_dir,
            spill_reserve_bytes=int(self.config.spill_reserve),
            sync_out=self.config.sync_out
            or (plan is not None and SyncMode(plan.sync_mode).waits_out),
        )
        if self.config.tier == "disk" or (
            self.config.tier == "auto" and not torch.cuda.is_available()
        ):
            self._offloader.check_ready(torch.device("cpu"))
        self.stats = LMSStats()
        self._resident_said = False
        self._lock = threading.RLock()
        self._step: Step | None = None
        self._record: policy.StepRecord | None = None
        self._live: dict[int, Entry] = {}
        self._by_storage: dict[tuple[str, int], tuple[weakref.ref[Any], Entry]] = {}
        self._keep = Keep(self.config.min_offload)
        models = [model] if isinstance(model, torch.nn.Module) else list(model or ())
        for each in models:
            if not isinstance(each, torch.nn.Module):
                raise TypeError(f"lms: model= takes modules, not {type(each).__name__}")
            self._keep.note_model(each)
        self._models = models
        self._split: contextlib.ExitStack | None = None  # the plan's slabs, while a step runs
        self._keys = itertools.count()  # entry keys (spill file names), unique in this runtime
        self._active = False
        self._owner = ""
        self._hooks: Any = None
        self._module_hook: Any = None
        # Note: [No reference cycles through the runtime]
        # Its helpers get callables that do not hold the LMS object: a cycle would leave it (and
        # a failed step's handles) to the cyclic collector, which may run on an I/O thread while
        # this thread holds the lock that a handle's release takes.
        self._replays = Replays(self.stats, functools.partial(self._offloader.fetch, hold=True))
        self._back_bytes = 0  # bytes of offloaded storages brought back and not yet released
        self._dropped: collections.deque[Entry] = collections.deque()  # releases to carry out
        self._relief = Relief(self._offloader, self.stats, self._lock, self._keep, self._keys)
        self._finalizer = weakref.finalize(self, Offloader.close, self._offloader)
        self._log: StepLog | None = None
        self._retries_said = False
        self._tuned: tuple[Trace, DeviceSpec, bool] | None = None  # what `tune` planned from

    @property
    def config(self) -> LMSConfig:
        """The settings the steps run under (`lms.LMSConfig`)."""
        return self._follow.config

    @config.setter
    def config(self, config: LMSConfig) -> None:
        self._follow.config = config  # the fallback policy reads the budget from it

    @property
    def plan(self) -> Plan | None:
        """The plan steps follow (from `tune`, or given); None: the budget's own policy."""
        return self._follow.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._follow.plan = plan

    @property
    def priced_on(self) -> tuple[Trace, DeviceSpec, bool] | None:
        """What `tune` priced the plan on: the trace, the device spec (with the op times it
        measured) and whether at half precision; None before `tune`."""
        return self._tuned

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> Self:
        # Note: [One step at a time]
        # One LMS object runs one step at a time: its step state, hooks and stores are the step's.
        # The check and the claim are one action under the lock, so that of two threads entering
        # at once exactly one gets in and the other is refused at once, nothing of its set up.
        with self._lock:
            if self._active:
                raise LMSError(
                    f"lms: this LMS object is running a step already (entered on thread "
                    f"{self._owner!r}); steps do not nest, and each thread needs an LMS object "
                    "of its own"
                )
            if self.config.budget_share is not None:
                raise LMSError(
                    f"lms: budget='{100 * self.config.budget_share:g}%' is a share of the step's "
                    "peak without offload, which its trace tells: call tune(model, batch, step) "
                    "before the first step, or give the budget as a size such as '10GiB'"
                )
            self._active = True
            self._owner = threading.current_thread().name
        try:
            if self._log is not None:
                self._log.begin(self.stats.steps + 1, self.stats.as_dict())
            return self._enter()
        except BaseException:
            if self._split is not None:
                self._split.close()
                self._split = None
            self._active = False
            if self._log is not None:
                self._log.end(self.stats.as_dict())
            raise

    def _enter(self) -> Self:
        if self.plan is not None and self.plan.slabs:  # first: it may refuse
            model = self._split_model()
            self._split = contextlib.ExitStack()
            self._split.enter_context(split_modules(model, dict(self.plan.slabs)))
        with self._lock:
            self._relief.drop()
            previous = self._step
            if previous is not None and self._record is None and previous.entries:
                self._record = previous.to_record()
            self._step = Step(self.stats.steps + 1, self._record, self.plan)
            self.stats.steps += 1
            self._step.light = self._follow.runs_light()
            leave_modules()
            self._step.entered = allocator_now()
        # Note: [Hooks stay out of compiled graphs]
        # A model compiled in place runs the global module hook inside its compiled frame, and
        # the saved-tensor hooks where forward saves: torch.compile must call them as they are,
        # never trace them into a graph (they read addresses and take locks).
        pack, unpack = (
            (self._pack_light, self._unpack_light)
            if self._step.light
            else (self._pack, self._unpack)
        )
        if self._log is not None:
            pack, unpack = self._log.wrap(pack, "runtime"), self._log.wrap(unpack, "runtime")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            torch.compiler.disable(pack), torch.compiler.disable(unpack)
        )
        if not self._step.light and not self._keep.models:
            # A tuned or named model's parameters and buffers are known already: no hook on
            # every module call (nor torch.compile's warning about global module hooks).
            self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                torch.compiler.disable(self._note_module)
            )
        self._hooks.__enter__()
        if self.plan is not None and self.plan.recompute:
            self._replays.watch(self._keep.fixed_ptrs, self._entry_of, self._keep.min_bytes)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._exit(exc)
        finally:
            if self._log is not None:
                self._log.end(self.stats.as_dict())

    def _exit(self, exc: object) -> None:
        self._active = False
        self._replays.stop()
        self._hooks.__exit__(None, None, None)
        if self._split is not None:
            self._split.close()
            self._split = None
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        if exc is not None:
            self._abort()
            return
        with self._lock:
            self._release_dropped()
            step = self._step
            self._count_retries(step)
            if step is not None and not step.light:
                step.note_held_outside()
            if step is not None and step.number == 1 and step.entries:
                self._log_step(step)
            # a block where autograd saved nothing (evaluation, no_grad) is no step of the plan's
            # and no departure from it: it neither diverges nor counts as a step followed
            if step is not None and step.level == 0:
                step = None
            if (
                step is not None
                and self.plan is not None
                and not step.diverged
                and not step.light
                and len(step.entries) != self.plan.num_entries
            ):
                self._follow.diverge(step, len(step.entries), "plan was made for")
            if step is not None and step.diverged:
                self.stats.diverged_steps += 1
            self._follow.calibrate(step)
            if step is not None and not step.light and not step.diverged:
                self._replays.checked = self.plan
            if not self._live:
                self._offloader.tidy()
            # storages freed since: their addresses name other storages from now on
            self._by_storage = {
                slot: found for slot, found in self._by_storage.items() if found[0]() is not None
            }
            self._offloader.raise_error()

    def _count_retries(self, step: Step | None) -> None:
        """Count the allocator's retries during ``step``; say so, once (Note [The allocator
        gives memory back])."""
        now = allocator_now()
        if step is None or step.entered is None or now is None or now[0] != step.entered[0]:
            return
        retries = now[2] - step.entered[2]
        if retries <= 0:
            return
        self.stats.allocator_retries += retries
        if not self._retries_said:
            self._retries_said = True
            log.warning(
                "[LMS] step %d: the CUDA caching allocator found no room under its cap %d "
                "time(s), freed its cached blocks and mapped memory again, each time stopping "
                "the card for milliseconds a gigabyte; a budget lower than the cap leaves it room",
                step.number,
                retries,
            )

    @property
    def host_limit_bytes(self) -> int:
        """The host memory offloaded data may hold (`lms.LMSConfig.host_budget`, resolved)."""
        return self._offloader.host_limit_bytes

    def adopt(
        self,
        plan: Plan,
        *,
        priced_on: tuple[Trace, DeviceSpec, bool],
        model: torch.nn.Module,
    ) -> Plan:
        """Follow ``plan`` from the next step on: the plan `lms.LMS.tune` made for ``model``,
        and what it was priced on (the trace, the device spec, whether at half precision)."""
        self.plan = plan
        self._tuned = priced_on
        self._offloader.sync_out = self.config.sync_out or SyncMode(plan.sync_mode).waits_out
        self._keep.note_model(model)  # as in the trace
        if all(known is not model for known in self._models):
            self._models.append(model)
        return plan

    def _split_model(self) -> torch.nn.Module:
        """The model whose submodules the plan runs in slabs.

        Raises:
            LMSError: no model given to `LMS` (``model=``) or to `tune` has them all.
        """
        names = [name for name, _ in self.plan.slabs] if self.plan is not None else []
        for model in self._models:
            modules = dict(model.named_modules())
            if all(name in modules for name in names):
                return model
        raise LMSError(
            f"lms: the plan runs {', '.join(names)} in slabs, but no model given to LMS has "
            "them; pass the model as LMS(model=...), or tune() with it"
        )

    # -- step records ------------------------------------------------------------------------
    def record_steps(self, device: torch.device | str | None = None) -> None:
        """Record each step from the next one on, op by op: each op's start and end, each copy
        and wait, the memory in use (Note [One clock for a step record]); `save_record` writes
        them with the plan and what it was tuned from, for `lms replay`. Backward must run
        inside the ``with`` block to be recorded. ``device``: the step's (default: CUDA where
        there is one)."""
        where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        self._log = StepLog(where)
        self._offloader.record_to(self._log)

    def step_record(self, meta: dict[str, Any] | None = None) -> StepRecord:
        """The steps recorded so far, with the plan, the trace and the device spec `tune`
        planned from (``meta``: anything else to keep with them, JSON-ready).

        Raises:
            LMSError: nothing was recorded (`record_steps` first), or the plan was not tuned
                here (`tune`), so there is no trace to simulate it from again.
        """
        if self._log is None or not self._log.steps:
            raise LMSError(
                "lms: no steps were recorded; call record_steps() before the steps to record"
            )
        if self._tuned is None:
            raise LMSError(
                "lms: a step record needs the trace the plan was made from; tune the plan with "
                "LMS.tune(model, batch, step) before recording"
            )
        trace, spec, half = self._tuned
        info = self._log.meta()
        return StepRecord(
            trace=trace,
            plan=self.plan,
            spec=spec,
            half=half,
            steps=tuple(self._log.steps),
            meta={**info, **(meta or {})},
        )

    def save_record(self, path: str, meta: dict[str, Any] | None = None) -> None:
        """Write `step_record` to ``path`` (gzipped JSON, read by `lms replay`)."""
        self.step_record(meta).save(path)

    def close(self) -> None:
        """Release host buffers and spill files now (also done when the object is collected)."""
        with self._lock:
            self._relief.drop()
            self._offloader.close()

    def _abort(self) -> None:
        """The step failed: discard offloaded copies, spill files and idle pinned buffers."""
        with self._lock:
            self._relief.drop()
            entries = list(self._live.values())
            self._offloader.abort(entries)
            self._live.clear()
            self._by_storage.clear()
            self._step = None  # a failed step is no record to follow
            log.info(
                "[LMS] step %d failed; discarded %d offloaded storages",
                self.stats.steps,
                len(entries),
            )

    # -- hooks -----------------------------------------------------------------------------
    def _pack_light(self, tensor: torch.Tensor) -> Any:
        step, calibrated = self._step, self._follow.calibrated
        assert step is not None and calibrated is not None
        if not step.diverged:
            # _pack's check of the same bytes, inline: this is the hot path of a light step.
            step.saved_storage_bytes += storage_bytes(tensor)
            if step.saved_storage_bytes <= calibrated[1]:
                with self._lock:
                    step.level += 1
                    self.stats.saved_tensors += 1
                    self.stats.kept_tensors += 1
                return Kept(tensor)
            with self._lock:
                self._follow.diverge(step, step.level, "plan was made for")
        return self._pack(tensor)

    def _unpack_light(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, Kept):
            return packed.unpack()
        return self._unpack(packed)  # saved after the step diverged

    def _pack(self, tensor: torch.Tensor) -> Any:
        with self._lock:
            self._release_dropped()
            step = self._step
            assert step is not None
            if step.entries and not self._live and not in_backward():
                step.forward_again = True  # gradient accumulation in one block, say
            step.level += 1
            if step.to_empty:
                self._empty_due(step)
            self.stats.saved_tensors += 1
            if not step.light:
                step.saved_storage_bytes += storage_bytes(tensor)
                if self._follow.past_calibration(step):
                    self._follow.diverge(step, step.level, "plan was made for")
            plan = self.plan
            if (
                plan is not None
                and plan.relieved_junctions
                and not step.walked
                and tensor.grad_fn is not None
            ):
                step.saved_nodes.append(tensor.grad_fn)
            return self._hold(step, tensor)

    def _hold(self, step: Step, tensor: torch.Tensor) -> Any:
        """What autograd holds instead of ``tensor``, saved now (under the lock)."""
        if self._keep(tensor):
            wrapped = None if self._follow.following(step) else self._wrap(step, tensor)
            if wrapped is not None:
                return wrapped
            self.stats.kept_tensors += 1
            if self._keep.movable(tensor):
                self._note_held(step, tensor)
            return Kept(tensor)
        self._offloader.poll()
        storage = tensor.untyped_storage()
        slot = _slot(storage)
        found = self._by_storage.get(slot)
        entry = found[1] if found is not None and found[0]() is storage else None
        base = tensor if tensor._base is None else tensor._base
        if entry is not None and self._copies_again(step, entry, base):
            entry = self._twin(step, entry, storage, tensor.device, base)
            self._by_storage[slot] = (weakref.ref(storage), entry)
        elif (
            entry is None
            or entry.released
            or ((entry.offloaded or entry.recipe is not None) and not self._joins(entry, base))
        ):
            entry = self._new_entry(step, storage, tensor.device, base)
            self._by_storage[slot] = (weakref.ref(storage), entry)
            self._relief.note(step, self.plan, entry, tensor)
        entry.handles += 1
        entry.saves += 1
        return Handle(self._drop_handle, entry, tensor)

    def _wrap(self, step: Step, tensor: torch.Tensor) -> Wrapped | None:
        """A subclass that wraps plain tensors, held by its inner tensors where one of them may
        move (Note [Subclasses move by their inner tensors]); None: kept whole."""
        wrapped = wrapped_parts(tensor)
        if wrapped is None or offload_blocked() or is_weight(tensor):
            return None
        inner, others, context = wrapped
        if not any(self._keep.movable(t) or wrapped_parts(t) is not None for t in inner.values()):
            return None
        held = {name: self._hold(step, t) for name, t in inner.items()}
        return Wrapped(tensor, held, others, context)

    def _note_held(self, step: Step, tensor: torch.Tensor) -> None:
        """A save kept in place (inside `no_offload`, or a conjugate view) holds ``tensor``'s
        storage on the device for as long as autograd keeps it: without a plan, the runtime
        never moves that storage (with one, the planner kept it already; see `Trace.held`)."""
        storage = tensor.untyped_storage()
        slot = _slot(storage)
        step.held[slot] = weakref.ref(storage)
        found = self._by_storage.get(slot)
        if found is None or found[0]() is not storage or not step.owns(found[1]):
            return
        entry = found[1]
        entry.held = True
        if entry in step.resident and not self._follow.following(step):
            step.resident.remove(entry)  # stays with the save that holds it
            step.resident_bytes -= entry.nbytes

    @staticmethod
    def _joins(entry: Entry, base: torch.Tensor) -> bool:
        """Whether a view of ``base`` saved now may share the copy ``entry`` already took.

        Note: [Join a copied storage only through the same base at the same version]
        After a copy is taken, regions of the storage that no saved view covers may still
        change: RNN cells update chunks of one storage in place through views with version
        counters of their own. A view saved later joins the copy only when it comes from the
        same base tensor and that base's version (shared by all its ordinary views) has not
        moved since the copy; otherwise the storage is copied again: as a new entry, or, in a
        step that follows a plan that recomputes nothing, as a twin of the first (Note [A
        storage copied again keeps its place in the plan]).
        """
        owner = entry.base() if entry.base is not None else None
        return owner is base and base._version == entry.copied_version

    def _copies_again(self, step: Step, entry: Entry, base: torch.Tensor) -> bool:
        """Whether a save through ``base`` of the storage of ``entry`` (copied out already, or
        let go of) is a twin of it under its ordinal.

        Note: [A storage copied again keeps its place in the plan]
        The trace counts a storage once however many views of it are saved, but once its bytes
        have left the device, a view from another base, or from the same base at a later
        version, is copied again (Note [Join a copied storage only through the same base at the
        same version]): an RNN cell saves chunks of its gates, each a base of its own, and
        changes some in place between saves. As a new entry, that copy would shift every later
        ordinal off the plan's, and a step of a cell loop would leave its plan at its first
        cell. So does a storage saved again after autograd let go of all its saves (the indices
        that unsort a packed sequence). Such a save is a twin instead: an entry of the same
        ordinal, outside the step's list, moved out where the plan (or, without one, the record
        of the step before) moves that ordinal, else kept, and read back when backward reads it.
        A copy it makes is one the simulator does not price. Without a plan, steps then count
        their saves alike whichever storages the budget moved out, and follow their records.
        Not under a plan that recomputes:
        a replay names its inputs by entry (Note [Name a recipe's inputs by entry]), and which
        of the two copies holds the bytes an input was read with is not followed; a step of a
        plan that replays leaves it there, as any step whose saves are not the plan's.
        """
        replays = self.plan is not None and bool(self.plan.recompute)
        if step.diverged or replays or not step.owns(entry):
            return False
        if entry.released:
            return True
        return entry.offloaded and entry.recipe is None and not self._joins(entry, base)

    def _twin(
        self,
        step: Step,
        entry: Entry,
        storage: torch.UntypedStorage,
        device: torch.device,
        base: torch.Tensor,
    ) -> Entry:
        """A second entry of ``entry``'s ordinal for ``storage`` saved through ``base``, moved
        out or kept as the plan has that ordinal (Note [A storage copied again keeps its place
        in the plan])."""
        twin = Entry(next(self._keys), entry.ordinal, storage, device)
        twin.base = weakref.ref(base)
        self._live[twin.key] = twin
        step.twins.add(twin.key)
        if self._follow.offloads(step, twin):
            self._offload(twin)
            self._evict(step)
        else:
            step.resident.append(twin)
            step.resident_bytes += twin.nbytes
            self.stats.peak_resident_saved_bytes = max(
                self.stats.peak_resident_saved_bytes, step.resident_bytes
            )
        return twin

    def _new_entry(
        self,
        step: Step,
        storage: torch.UntypedStorage,
        device: torch.device,
        base: torch.Tensor,
    ) -> Entry:
        entry = Entry(next(self._keys), len(step.entries), storage, device)
        entry.base = weakref.ref(base)
        holder = step.held.get(_slot(storage))
        record = step.record
        entry.held = (holder is not None and holder() is storage) or (
            record is not None and not step.diverged and entry.ordinal in record.held
        )
        self._live[entry.key] = entry
        step.entries.append(entry)
        step.save_level[entry.ordinal] = step.level
        self._replays.saved(storage, entry)
        self.stats.saved_bytes += entry.nbytes
        step.largest_bytes = max(step.largest_bytes, entry.nbytes)
        if step.baseline_bytes is None:
            step.baseline_bytes = self._baseline(step, device)
            step.first_call = None  # its arguments let go of
            budgeted = self.config.budget_bytes is not None or self.plan is not None
            if device.type == "cpu" and budgeted and not self._resident_said:
                self._hold_resident()
        # Note: [The budget's wait follows the simulator]
        # While the copies out still running would take a step past its budget, the runtime
        # waits for the oldest (`_evict`). A step that follows its plan does so where the
        # simulator does (`lms.analysis.clock.Clock`): after a save it copies out, not after one
        # it keeps or recomputes. Checked after every save, a 3D U-Net at 256^3 on an H200 stood
        # 38 ms in forward where its simulation waited nowhere; a step without a plan, which
        # has no simulation to answer for it, checks after every save.
        if self._recompute(step, entry, storage):
            pass
        elif self._follow.offloads(step, entry):
            self._offload(entry)
            if entry.offloaded:
                entry.empty_at = self._follow.empty_at(step, entry)
                entry.gaps = self._follow.gaps(step, entry)
            if entry.empty_at is not None or entry.gaps:
                step.to_empty.append(entry)
            self._evict(step)
        elif entry.held and not self._follow.following(step):
            pass  # stays with the save that holds it, counted as kept saves are
        else:
            step.resident.append(entry)
            step.resident_bytes += entry.nbytes
            if not self._follow.following(step):
                self._evict(step)
        self.stats.peak_resident_saved_bytes = max(
            self.stats.peak_resident_saved_bytes, step.resident_bytes
        )
        if not self._follow.following(step):
            step.policy_peak_bytes = max(step.policy_peak_bytes, step.resident_bytes)
        return entry

    def _note_module(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """The global module hook: ``module``'s parameters and buffers stay; the first module a
        step calls is taken as its model, and that call's tensors as its batch (Note [What a
        budget on the CPU starts from])."""
        self._keep.note_module(module, args)
        step = self._step
        if step is not None and step.first_call is None and step.baseline_bytes is None:
            step.first_call = (module, args)  # its storages counted only where a CPU save asks

    def _baseline(self, step: Step, device: torch.device) -> int:
        """What the budget holds before ``step``'s first save on ``device``.

        Note: [What a budget on the CPU starts from]
        On a GPU the budget counts everything allocated on the device when the step began: its
        weights, its batch, whatever else is there, as the simulator counts what is allocated
        before the first op that saves. Read at the first save instead, it would hold that op's
        output too where the op saves its output, which the step then counts again among its
        saved tensors. A CPU has no such count beside the whole process's, so the runtime
        counts what the budget does there (`LMSConfig.budget`): the host storages of the models
        it knows (``model=``, `tune`; no hook then sees the batch, which goes uncounted), else of
        the first module the step calls and the tensors that call is given.
        """
        if device.type == "cuda":
            entered = step.entered
            index = device.index if device.index is not None else torch.cuda.current_device()
            if entered is not None and entered[0] == index:
                return entered[1]
            return torch.cuda.memory_allocated(device)
        if device.type != "cpu":
            return 0
        first: dict[tuple[torch.device, int], int] = {}
        if step.first_call is not None:
            module, args = step.first_call
            tensors = [*module.parameters(), *module.buffers(), *args]
            first = distinct_storages(tensors, device_type="cpu")
        return sum({**self._keep.host_weights, **first}.values())

    def _hold_resident(self) -> None:
        """Once, at the first save on the CPU of a step with a budget or a plan: make the budget
        hold for the resident set, or say that it may not (Note [The resident set follows the
        heap under a budget])."""
        self._resident_said = True
        budget = (
            f"the budget of {format_bytes(self.config.budget_bytes)}"
            if self.config.budget_bytes is not None
            else "the plan's budget"
        )
        if self.config.cpu_resident and release_freed_memory():
            log.info(
                "[LMS] On the CPU, %s holds for this process's resident set: allocations of "
                "%s and more now go back to the system when freed (glibc's mmap threshold), "
                "and are faulted in afresh each step; cpu_resident=False keeps glibc's own "
                "setting, for speed",
                budget,
                format_bytes(MAPPED_ALONE_BYTES),
            )
        else:
            why = (
                "cpu_resident=False"
                if not self.config.cpu_resident
                else "the C allocator is not glibc's"
            )
            log.warning(
                "[LMS] On the CPU, %s holds for the C heap in use; the resident set may pass "
                "it by what the allocator keeps of freed memory (%s)",
                budget,
                why,
            )

    def _recompute(self, step: Step, entry: Entry, storage: torch.UntypedStorage) -> bool:
        """Drop ``entry``'s storage now and recompute it in backward, if the plan says so."""
        if not self._replays.watching or not self._follow.recomputes(step, entry):
            return False
        if self._replays.take(entry, storage, check=self._replays.checked is not self.plan):
            return True
        if entry.ordinal not in self._replays.unreplayable:  # those were warned about
            log.info(
                "[LMS] saved storage %d has no recipe at run time; offloading it instead",
                entry.ordinal,
            )
        self._follow.offload_instead(step, entry)
        return False

    def _entry_of(self, storage: torch.UntypedStorage) -> Entry | None:
        """The live entry that saved ``storage`` in this step, if any."""
        found = self._by_storage.get(_slot(storage))
        if found is None or found[0]() is not storage or found[1].released:
            return None
        step = self._step
        return found[1] if step is not None and step.owns(found[1]) else None

    def _evict(self, step: Step) -> None:
        """Move the oldest resident entries out while the threshold or the budget demands it."""
        for oldest in self._follow.evictions(step):
            if not oldest.released:
                self._offload(oldest)
        limit = self._follow.allowance(step)
        if limit is None:
            return
        # Evicted storages occupy the device until their copy out is done: wait for the oldest
        # while they would take the step over its budget.
        while self._offloader.pending_bytes and (
            step.resident_bytes + self._offloader.pending_bytes > limit
        ):
            self._offloader.wait_oldest()

    def _offload(self, entry: Entry) -> None:
        entry.note_copied()
        self._offloader.offload(entry, to_disk=self._follow.spills(self._step, entry))
        if entry.offloaded:
            step = self._step
            if step is not None and step.owns(entry):
                step.note_offloaded(entry)
            self.stats.offloaded_tensors += 1
            self.stats.offloaded_bytes += entry.nbytes
            if entry.on_disk:
                self.stats.spilled_bytes += entry.nbytes
            self.stats.peak_host_bytes = max(
                self.stats.peak_host_bytes, self._offloader.peak_host_bytes
            )
            self.stats.peak_disk_bytes = max(
                self.stats.peak_disk_bytes, self._offloader.peak_disk_bytes
            )

    def _unpack(self, packed: Any) -> torch.Tensor:
        step = self._step
        if step is not None and step.junction_edges and not step.walked:
            self._relief.hook(step, self.plan)
        with self._lock:
            # Copies out that have finished let their device memory go now, as the simulator
            # frees it: forward's last storages, whose copies backward may still find running,
            # not only when backward reads or prefetches them; relieved partial gradients too.
            self._offloader.poll()
            if not isinstance(packed, Handle) and self._step is not None:
                self._step.level += 1  # kept, or a subclass around its inner tensors
        return self._bring_back(packed, counted=isinstance(packed, Handle))

    def _bring_back(self, packed: Handle | Kept | Wrapped, *, counted: bool) -> torch.Tensor:
        """The tensor ``packed`` holds, from wherever it is now; ``counted``: this read is a
        level of its own (not one of the inner tensors of a `Wrapped`)."""
        if isinstance(packed, Kept):
            return packed.unpack()
        if isinstance(packed, Wrapped):
            return packed.remake(functools.partial(self._bring_back, counted=False))
        packed.check()
        entry = packed.entry
        with self._lock:
            self._release_dropped()
            step = self._step
            if step is not None and step.owns(entry):
                if counted:
                    step.level += 1
                if step.to_empty:
                    if entry in step.to_empty:  # read before it was emptied: it stays
                        step.to_empty.remove(entry)
                    self._empty_due(step)
                step.first_use.setdefault(entry.ordinal, step.level)
                self._prefetch_after(step, entry)
            entry.uses += 1
            # A storage saved as several views stays loaded until each view was read once and
            # no replay still to come reads it, unless the plan reads it back for each use.
            # Reads are counted against the saves, not the handles: those fall as autograd lets
            # go of what it has read.
            hold = (entry.uses % entry.saves != 0 or entry.replays > 0) and not (
                self._follow.refetches(step, entry)
            )
            if entry.recipe is not None:
                with self._log.section("replay") if self._log else contextlib.nullcontext():
                    storage, waited = self._replays.remake(entry, hold=hold)
            else:
                if entry.offloaded:
                    self._mark_back(entry)
                storage, waited = self._offloader.fetch(entry, hold=hold)
            self.stats.wait_s += waited
            self.stats.reloaded_bytes = self._offloader.loaded_bytes
            if storage is not entry.storage:
                # Note: [A storage brought back is its entry's storage]
                # The trace sees one storage where the runtime brings a copy back: a double
                # backward (a gradient penalty, MAML) saves what the first backward read, and a
                # reentrant checkpoint saves its reloaded input as its recomputation runs. Found
                # by its entry, such a save is a twin of it under its ordinal (Note [A storage
                # copied again keeps its place in the plan]) rather than a new entry that
                # shifts every later ordinal off the plan's.
                self._by_storage[_slot(storage)] = (weakref.ref(storage), entry)
        out = torch.empty(0, dtype=packed.dtype, device=entry.device)
        return out.set_(storage, packed.offset, packed.size, packed.stride)

    def _empty_due(self, step: Step) -> None:
        """Empty the entries whose event has come and whose copy out has finished (Note
        [Emptying what the code holds]); the rest wait for a later event."""
        self._offloader.poll()
        waiting = []
        for entry in step.to_empty:
            if step.diverged and entry.gaps:  # the plan's events no longer say when
                self._fill_gap(entry)
                entry.gaps = []
            while entry.gaps and step.level >= entry.gaps[0][1]:  # forward reads it next
                self._fill_gap(entry)
                entry.gaps.pop(0)
            if entry.gaps and step.level >= entry.gaps[0][0]:  # in a gap: out, for the plan
                if not entry.emptied and not entry.back and not entry.released:
                    self._offloader.empty_now(entry)
                waiting.append(entry)
                continue
            if not entry.gaps and entry.empty_at is None:
                continue  # past its last gap: forward's last read lets it go
            start = entry.gaps[0][0] if entry.gaps else entry.empty_at or 0
            if entry.pending_out is not None or step.level < start:
                waiting.append(entry)
                continue
            if entry.offloaded and not entry.back and not entry.released:
                self._offloader.empty(entry)
        step.to_empty = waiting
        self.stats.emptied_bytes = self._offloader.emptied_bytes

    def _fill_gap(self, entry: Entry) -> None:
        """Fill ``entry`` again from its copy if a gap emptied it (Note [Gaps in what the code
        holds]), waiting for the read."""
        if entry.emptied:
            self._offloader.fill(entry)
            self.stats.gap_fills += 1
            self.stats.gap_filled_bytes += entry.nbytes

    def _prefetch_after(self, step: Step, entry: Entry) -> None:
        """Start loading the next offloaded entries backward will read after ``entry``."""
        prefetch = self._follow.prefetch(step)
        if prefetch is None:
            return
        queue = step.backward_queue()
        position = step.use_pos.get(entry.ordinal)
        if position is None:
            return
        ahead, allowance = prefetch
        started = 0
        offloaded = step.offloaded_at  # only these can need loading: no scan of the kept ones
        index = bisect.bisect_right(offloaded, position)
        while started < ahead and index < len(offloaded):
            upcoming = queue[offloaded[index]]
            index += 1
            if upcoming.released or not upcoming.offloaded:
                continue
            started += 1
            if upcoming.back:
                continue
            on_device = step.resident_bytes + self._back_bytes + upcoming.nbytes
            if allowance is not None and on_device > allowance:
                break
            if self._offloader.prefetch(upcoming):
                self._mark_back(upcoming)
                self.stats.prefetched_bytes += upcoming.nbytes

    def _mark_back(self, entry: Entry) -> None:
        if not entry.back:
            entry.back = True
            self._back_bytes += entry.nbytes

    def _drop_handle(self, entry: Entry) -> None:
        """Autograd let go of a handle on ``entry``.

        Note: [A handle may be released on any thread]
        A handle is released where its graph is freed, and the cyclic collector may free one on
        an I/O thread while this runtime's lock is held by a thread that waits for that I/O
        thread. So a release that cannot take the lock at once is queued, and the holder
        carries it out the next time it saves or reads a tensor, or ends the step.
        """
        self._dropped.append(entry)
        if self._lock.acquire(blocking=False):
            try:
                self._release_dropped()
            finally:
                self._lock.release()

    def _release_dropped(self) -> None:
        """Carry out the queued releases (see Note [A handle may be released on any thread])."""
        while self._dropped:
            entry = self._dropped.popleft()
            entry.handles -= 1
            if entry.handles > 0:
                continue
            step = self._step
            if step is not None and entry in step.resident:
                step.resident.remove(entry)
                step.resident_bytes -= entry.nbytes
            if entry.back:
                entry.back = False
                self._back_bytes -= entry.nbytes
            self._offloader.release(entry)
            self._live.pop(entry.key, None)
            recipe, entry.recipe = entry.recipe, None
            if recipe is not None:
                for source in recipe.inputs:
                    source.replays -= 1
                self._dropped.extend(recipe.inputs)
            if not self._active and not self._live:
                self._offloader.tidy()

    # -- report ----------------------------------------------------------------------------
    def _log_step(self, step: Step) -> None:
        log.info(
            "[LMS] step %d saved %d storages (%s); offloaded %d (%s), %s to disk; "
            "peak resident saved %s%s",
            step.number,
            len(step.entries),
            format_bytes(sum(e.nbytes for e in step.entries)),
            self.stats.offloaded_tensors,
            format_bytes(self.stats.offloaded_bytes),
            format_bytes(self.stats.spilled_bytes),
            format_bytes(self.stats.peak_resident_saved_bytes),
            f"; filled {self.stats.gap_fills} held storages again in forward"
            if self.stats.gap_fills
            else "",
        )
        allowance = self._follow.allowance(step)
        budget = self.config.budget_bytes
        if allowance is None or budget is None or self._follow.following(step):
            return
        start = step.baseline_bytes or 0
        cuda = step.entries[0].device.type == "cuda"
        log.info(
            "[LMS] Without a plan, the budget of %s holds %s that the step started from (%s), "
            "%s kept free for the running op, and %s of saved tensors",
            format_bytes(budget),
            format_bytes(start),
            "allocated on the device" if cuda else "weights and batch",
            format_bytes(budget - start - allowance),
            format_bytes(max(allowance, 0)),
        )
        floor = budget - allowance  # what the step started from, and the running op's room
        # Note: [A step that left its plan answers for the rest]
        # A step that followed its plan up to a save that differs (a compiled graph saves other
        # tensors than the eager step the plan counts) kept until then what the plan keeps,
        # within the budget as simulated, and beyond the policy's own allowance, which reserves
        # room for the largest op that a plan's simulation knows exactly. Only what it held on
        # the budget's own policy, from that save on, says whether that policy held the budget.
        held = step.policy_peak_bytes
        if allowance < 0 or held > allowance:
            log.warning(
                "[LMS] The budget of %s did not hold this step without a plan: it needs at "
                "least %s (%s it started from and kept free for the running op, and %s of saved "
                "tensors that stayed on the device); raise the budget to that, or tune a plan "
                "(LMS.tune) that offloads or recomputes more",
                format_bytes(budget),
                format_bytes(floor + held),
                format_bytes(floor),
                format_bytes(held),
            )

    @property
    def spill_folder(self) -> str | None:
        """The folder holding this runtime's spill files, while it has one."""
        disk = self._offloader.disk
        return disk.folder if disk is not None else None
