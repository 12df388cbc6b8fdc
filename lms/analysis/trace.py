"""Trace one training step under fake tensors: every op, storage and saved-tensor event.

No real memory is used: parameters, inputs and every intermediate are `FakeTensor`s, so a step that
needs 90 GiB on a GPU traces in seconds on a small CPU machine.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import itertools
import logging
import random
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from lms.analysis import fsdp
from lms.analysis.cardkernels import CardKernels
from lms.analysis.recorder import DEVICE_QUERY, OpsPastLimitError, Recorder, dense_parts
from lms.analysis.values import Values
from lms.core.config import AUTO_MIN_OFFLOAD_BYTES
from lms.core.errors import LMSError, StepStateError, UnplannableStepError, step_failed
from lms.core.keep import is_plain, leave_modules
from lms.core.records import Trace
from lms.core.slabs import SplitError, split_modules

__all__ = ["trace_step", "default_step", "primary_output", "batch_shape", "StepFn"]

log = logging.getLogger("lms.analysis")

StepFn = Callable[[torch.nn.Module, Any], Any]


def default_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Forward, the loss, backward; returns the loss.

    A mapping batch is passed by keyword (``model(**batch)``, a Hugging Face tokenizer's
    output), a tensor as the one argument, a sequence as the arguments. The loss is the model's
    own where its output carries one (a Hugging Face model given ``labels``), else a mean over
    its `primary_output`.
    """
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, torch.Tensor):
        out = model(batch)
    else:
        out = model(*batch)
    own = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    loss = own if isinstance(own, torch.Tensor) else primary_output(out).float().mean()
    del out, own  # the output's tensors are the plan's to move while backward runs
    loss.backward()
    return loss


def primary_output(out: object) -> torch.Tensor:
    """The tensor a model's output leads with: itself, a segmentation dict's ``"out"``, a Hugging
    Face output's ``logits``, or the first of a tuple or dict.

    Raises:
        TypeError: the output holds no tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        return primary_output(out["out"] if "out" in out else next(iter(out.values())))
    if hasattr(out, "logits"):
        return primary_output(out.logits)
    if isinstance(out, (tuple, list)) and out:
        return primary_output(out[0])
    raise TypeError(f"lms: the model returned {type(out).__name__}, which holds no tensor")


# Note: [A mask of ones is known as such]
# A Hugging Face model given an attention mask of ones (no padding, as a tokenizer gives for
# sequences of one length), or none, from which it may make one of ones itself (BART's decoder:
# ``torch.ones``, cast to bool), asks whether SDPA can do without it: with real tensors it reads
# the values, skips the mask and lets SDPA mask causally by itself; with fake ones it cannot, and
# builds the mask. The traced step would then save and run what the real one does not (a mask,
# and on a GPU another attention kernel), and the runtime would find its plan made for another
# step. So while a step that runs a Hugging Face model is traced (the model itself or one inside
# the user's, a Lightning module's), `_Ones` follows the fake tensors known to hold ones: the
# fake copies of the batch's integer and boolean tensors whose real values are all ones, and
# what ``ones``, or ``full`` of a value other than zero, makes, and what is cast, copied or
# viewed from one of them. Asked about such a mask, Hugging Face's checks are given none in its
# place, and decide as the real step does. A mask of any other making (one that pads) is left to
# them, and builds a mask in both. Releases before those checks (before 4.53) read the mask's
# values themselves: there a batch's mask of ones is traced as none, which means the same.
_MASK_CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
"""Hugging Face's checks (``transformers.masking_utils``) of whether a padding mask can be left
out; each takes the mask first."""
_ONES = {"ones", "new_ones"}
_FULLS = {"full": 1, "new_full": 2}  # the position of the fill value
_KEEPS = {"_to_copy", "clone", "contiguous", "to", "detach"}


class _Ones(TorchDispatchMode):
    """Which fake tensors hold ones (Note [A mask of ones is known as such]): ``known`` to begin
    with, and those made from them, or made of ones, while it is on."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        for tensor in known:
            self.seen[tensor] = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is DEVICE_QUERY:  # Note [A fake tensor's device is asked for, not recorded]
            return out
        name = func.overloadpacket.__name__
        if name in _ONES:
            ones = True
        elif name in _FULLS:
            value = args[_FULLS[name]] if len(args) > _FULLS[name] else None
            ones = isinstance(value, (bool, int, float)) and value != 0
        else:
            keeps = func.is_view or name in _KEEPS
            ones = keeps and bool(args) and isinstance(args[0], torch.Tensor) and args[0] in self
        if ones and isinstance(out, torch.Tensor):
            self.seen[out] = True
        return out

    def __contains__(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self.seen


class _Padded(TorchFunctionMode):
    """Runs `torch.nn.utils.rnn.pad_packed_sequence`'s C++ with the lengths it writes on the
    host real (Note [A packed sequence's batch sizes are real])."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) != "_pad_packed_sequence":
            return func(*args, **(kwargs or {}))
        with _RealHostIntegers():
            return func(*args, **(kwargs or {}))


class _RealHostIntegers(TorchDispatchMode):
    """Makes the integer tensors allocated on the CPU real while it is on."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten.empty.memory_format
            and kwargs.get("dtype") == torch.int64
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
        ):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _holds_ones(tensor: object) -> bool:
    """Whether ``tensor`` is a real integer or boolean tensor whose values are all ones (Note [A
    mask of ones is known as such])."""
    if (
        not isinstance(tensor, torch.Tensor)
        or not is_plain(tensor)
        or tensor.is_meta
        or tensor.is_floating_point()
        or tensor.is_complex()
        or not tensor.numel()
    ):
        return False
    with _disable_current_modes():
        return bool((tensor == 1).all())


def _runs_hugging_face(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or holds, a Hugging Face model."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and any(
        isinstance(m, transformers.PreTrainedModel) for m in model.modules()
    )


def _mask_checks() -> dict[str, Callable[..., bool]]:
    """Hugging Face's mask checks (`_MASK_CHECKS`) where its release has them (from 4.53 on)."""
    masking = sys.modules.get("transformers.masking_utils")
    return {name: getattr(masking, name) for name in _MASK_CHECKS if hasattr(masking, name)}


def _without_a_mask_of_ones(given: Any, inputs: Any) -> Any:
    """``inputs`` without their attention mask where ``given``'s is of real ones, for a Hugging
    Face release without mask checks to decide on a known one (Note [A mask of ones is known as
    such]): it read the mask's values to skip it, which fake tensors do not have, and a mask of
    ones means what none means."""
    if (
        not isinstance(given, Mapping)
        or not isinstance(inputs, dict)
        or not _holds_ones(given.get("attention_mask"))
    ):
        return inputs
    return {**inputs, "attention_mask": None}


@contextlib.contextmanager
def _masks_of_ones_known(
    checks: dict[str, Callable[..., bool]], real: list[Any], fake: list[Any]
) -> Iterator[None]:
    """While a step that runs a Hugging Face model is traced, its ``checks`` (`_mask_checks`) of
    a mask known to hold ones (the fake copies, ``fake``, of the batch's tensors of real ones,
    ``real``, or one made so) take none in its place (Note [A mask of ones is known as such])."""
    if not checks:
        yield
        return
    masking = sys.modules["transformers.masking_utils"]
    ones = _Ones([copy for given, copy in zip(real, fake, strict=True) if _holds_ones(given)])

    def knowing(check: Callable[..., bool]) -> Callable[..., bool]:
        @functools.wraps(check)
        def decide(*args: Any, **kwargs: Any) -> bool:
            if args and args[0] in ones:
                args = (None, *args[1:])
            elif kwargs.get("padding_mask") in ones:
                kwargs["padding_mask"] = None
            return check(*args, **kwargs)

        return decide

    for name, check in checks.items():
        setattr(masking, name, knowing(check))
    try:
        with ones:
            yield
    finally:
        for name, check in checks.items():
            setattr(masking, name, check)


# Note: [Packed sequences are found from the positions' values]
# Without an attention mask or a cache (a training step given tokens alone), Hugging Face looks
# for several sequences packed in one row (`find_packed_sequence_indices`): where the position
# ids restart, and, where none does, it builds no mask and lets SDPA mask causally. It reads the
# positions' values for that, unless it is traced, and it counts fake tensors as traced: it then
# keeps the packing and builds a mask, and the traced step saves a mask and runs another kernel
# than the real one (a Llama under the Trainer left its plan at the first layer). Position ids
# come from the batch or from ``arange``, whose values the trace has (Note [A value the step reads
# is computed for real]): so while a Hugging Face model is traced, that check is made with the
# fake tensors counted as untraced, and the read goes to the real values. Where they cannot be
# had, the check runs as before and keeps the packing.
_PACKING = "find_packed_sequence_indices"


@contextlib.contextmanager
def _packing_read(hugging_face: bool) -> Iterator[None]:
    """While a Hugging Face model is traced, its search for packed sequences reads the position
    ids' real values (Note [Packed sequences are found from the positions' values])."""
    masking: Any = sys.modules.get("transformers.masking_utils") if hugging_face else None
    find = getattr(masking, _PACKING, None)
    traced = getattr(masking, "is_tracing", None)
    if find is None or traced is None:
        yield
        return

    def untraced(tensor: Any = None) -> bool:
        return bool(traced(None))  # compiling, exporting or capturing, but a fake tensor is not

    @functools.wraps(find)
    def read(*args: Any, **kwargs: Any) -> Any:
        masking.is_tracing = untraced
        try:
            return find(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            pass  # the positions' values are not to be had
        finally:
            masking.is_tracing = traced
        return find(*args, **kwargs)

    setattr(masking, _PACKING, read)
    try:
        yield
    finally:
        setattr(masking, _PACKING, find)


def _as(kind: type, items: dict[str, Any]) -> Any:
    """``items`` as a mapping of ``kind``, or as the dict they are where ``kind`` is not built
    from one."""
    try:
        return kind(items)
    except Exception:  # a mapping type of the user's: its constructor may take anything
        return items


def _refuse_sharded(model: torch.nn.Module, name: str, units: list[fsdp.Unit]) -> None:
    """Refuse a model whose parameters are sharded across processes by anything but FSDP2's
    ``units``: fake tensors stand in for the local shards, not for the collectives that gather
    them (Note [FSDP2's layers traced whole]).

    Raises:
        UnplannableStepError: naming the first such parameter.
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    sharded = {id(getattr(module, param)) for unit in units for module, param, _, _ in unit.params}
    for where, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, DTensor) and id(tensor) not in sharded:
            raise UnplannableStepError(
                f"lms: {name}'s {where} is a {type(tensor).__name__} sharded across "
                "processes (tensor parallel), which a trace under fake tensors cannot stand in "
                "for; run lms.LMS(budget=...) without tune (with Lightning, "
                "LMSCallback(tune=False)): its runtime keeps the newest saved tensors within "
                "the budget in each process"
            )


def _refuse_lazy(model: torch.nn.Module) -> None:
    """Refuse a model whose lazy modules have not made their parameters yet.

    A lazy module (`torch.nn.LazyLinear`) makes them at its first call, in place, and then
    changes its class and drops its hooks: traced, that first call would happen under fake
    tensors and leave the model changed for good. The runtime itself takes such a model; only
    tracing needs it whole first.
    """
    for name, module in model.named_modules():
        own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if any(is_lazy(tensor) for tensor in own):
            raise UnplannableStepError(
                f"lms: {type(model).__name__}.{name} ({type(module).__name__}) is a lazy module "
                "that has not made its parameters yet, and a trace cannot make them; run one "
                "step (or one forward) before tuning, or use lms.LMS without tune for the first "
                "step"
            )


_BUILT_REAL: weakref.WeakSet[Callable[[], torch.nn.Module]] = weakref.WeakSet()
"""Builders that could not be built under fake tensors: a step traced again (in slabs, for
another size) builds them for real at once, without trying, or saying so, again."""


def _builds_real(model: Callable[[], torch.nn.Module]) -> bool:
    try:
        return model in _BUILT_REAL
    except TypeError:  # a builder that takes no weak reference
        return False


def _remember_real(model: Callable[[], torch.nn.Module]) -> None:
    with contextlib.suppress(TypeError):  # a builder that takes no weak reference
        _BUILT_REAL.add(model)


def _build(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    fake_mode: FakeTensorMode,
    target: torch.device,
) -> tuple[torch.nn.Module, bool]:
    """The module to trace, and whether it is real (its state to be faked while tracing).

    A builder runs under fake tensors, so that a model too large for this machine's memory
    costs none. One whose own code reads a tensor's value (RegNet computes its widths with
    tensors), which fake tensors cannot give, converts the module it made
    (``.to(memory_format=torch.channels_last)``, which PyTorch cannot do to fake parameters), or
    fails under fake tensors otherwise, is built for real instead; where the real build fails
    too, its own error is raised. Layers it deep-copies are copied as fake tensors (Note [A fake
    tensor deep-copied]).
    """
    if isinstance(model, torch.nn.Module):
        _refuse_lazy(model)
        return model, True
    if _builds_real(model):  # said once, at its first trace
        built, real = model(), True
    else:
        try:
            with fake_mode, torch.device(target), _fake_deepcopy():
                built, real = model(), False
        except Exception as error:  # the user's builder: fake tensors cannot run it
            if "UninitializedParameter" in str(error):  # a lazy module: fake tensors cannot make
                lazy = None
                with contextlib.suppress(Exception), torch.device("meta"):  # named, at no cost
                    lazy = model()
                if isinstance(lazy, torch.nn.Module):
                    _refuse_lazy(lazy)
                raise
            built, real = _built_for_real(model, error)
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"lms: the model builder returned {type(built).__name__}, not a module")
    return built, real


# Note: [A fake tensor deep-copied]
# A builder may copy a layer it made with `copy.deepcopy` (MONAI's SegResNetDS2 copies its
# decoder so). Under fake tensors a parameter's copy is a clone, which fake tensors make; but a
# buffer's (a batch norm's running statistics) goes through its storage, which PyTorch cannot
# give a fake tensor, and the failed copy left the process's heap corrupted: it aborted at exit.
# So while a builder runs under fake tensors, a fake tensor's deep copy is its clone.
_DEEPCOPY = "__deepcopy__"


@contextlib.contextmanager
def _fake_deepcopy() -> Iterator[None]:
    """Deep copies of fake tensors made as clones while in the block (Note [A fake tensor
    deep-copied])."""

    def deepcopy(self: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
        copied: torch.Tensor | None = memo.get(id(self))
        if copied is None:
            with torch.no_grad():
                copied = self.clone()
            memo[id(self)] = copied.requires_grad_(self.requires_grad)
        return copied

    before = FakeTensor.__dict__.get(_DEEPCOPY)
    setattr(FakeTensor, _DEEPCOPY, deepcopy)
    try:
        yield
    finally:
        if before is None:
            delattr(FakeTensor, _DEEPCOPY)
        else:
            setattr(FakeTensor, _DEEPCOPY, before)


def _built_for_real(
    model: Callable[[], torch.nn.Module], error: Exception
) -> tuple[torch.nn.Module, bool]:
    """``model`` built for real, where building it under fake tensors raised ``error``; the
    real build's own error, where it fails too, is the builder's."""
    built = model()
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
        why = f"reads the value of a tensor ({error.func}), which fake tensors do not have"
    elif str(error).startswith("_apply(): Couldn't swap"):
        why = f"converts its parameters ({error}), which PyTorch cannot do to fake ones"
    else:
        why = f"fails under fake tensors ({type(error).__name__}: {error})"
    log.info("[LMS] the model's builder %s; building it for real on the CPU", why)
    _remember_real(model)
    return built, True


# Note: [Fake weights share their buffer]
# A recurrent module on a GPU keeps its weights in one buffer (`flatten_parameters`), and cuDNN's
# RNN call takes that buffer whole and saves it for backward: a parameter, which stays. Faked one
# by one, the weights would lie apart, cuDNN's fake call would get no buffer (its backward then
# fails for want of one), and the trace would lose the sharing. So tensors of the model that share
# a storage get fake views of one fake storage of its size, at their own offsets; the trace then
# hands cuDNN's call the buffer the real one finds (`lms.analysis.recorder`).
def _shared_storages(model: torch.nn.Module) -> dict[tuple[str, int], torch.Tensor | None]:
    """The storages (by device and address) that two or more of the model's tensors view, each
    with its fake copy once made (None until then)."""
    seen = collections.Counter(
        _storage_key(value) for value in itertools.chain(model.parameters(), model.buffers())
    )
    return {key: None for key, count in seen.items() if key is not None and count > 1}


def _as_dict(batch: Any) -> bool:
    """Whether the trace fakes ``batch`` as a dict: a mapping that pytree does not know (a
    tokenizer's BatchEncoding)."""
    return isinstance(batch, Mapping) and type(batch) is not dict


def _batch_leaves(batch: Any) -> tuple[list[Any], TreeSpec]:
    """The batch's leaves and structure as the trace fakes them (`_as_dict`)."""
    return tree_flatten(dict(batch) if _as_dict(batch) else batch)


def batch_shape(batch: Any) -> tuple[Any, ...]:
    """What a trace of ``batch`` depends on besides the model and the step: its structure, each
    tensor's shape, strides, dtype and device, whether it requires a gradient and which of them
    share a storage (as the trace fakes them, `trace_step`), and its other leaves (numbers,
    strings and flags by value, anything else by type)."""
    leaves, structure = _batch_leaves(batch)
    storages: dict[tuple[str, int], int] = {}
    found: list[Any] = [structure]
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            key = _storage_key(leaf)
            shared = storages.setdefault(key, position) if key is not None else position
            found.append(
                (
                    tuple(leaf.shape),
                    leaf.stride(),
                    leaf.dtype,
                    leaf.device,
                    shared,
                    leaf.requires_grad,
                )
            )
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            found.append((type(leaf), leaf))
        else:
            found.append(type(leaf))
    return tuple(found)


def _storage_key(value: torch.Tensor) -> tuple[str, int] | None:
    if not is_plain(value) or value.device.type == "meta":
        return None
    pointer = value.untyped_storage().data_ptr()
    return (str(value.device), pointer) if pointer else None


def _fake_like(
    value: torch.Tensor, device: torch.device, shared: dict[tuple[str, int], torch.Tensor | None]
) -> torch.Tensor:
    """A fake tensor of ``value``'s shape, strides and dtype on ``device``: a view of the fake
    copy of its storage where the model's tensors share it."""
    if not is_plain(value) and type(value).__name__ == "DTensor":  # FSDP2's shard: whole
        return torch.empty(value.shape, dtype=value.dtype, device=device)
    key = _storage_key(value)
    nbytes = value.untyped_storage().nbytes()
    if key not in shared or nbytes % value.element_size():
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    storage = shared[key]
    if storage is None:
        storage = shared[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    words = storage.view(value.dtype)
    return words.as_strided(value.shape, value.stride(), value.storage_offset()).detach()


@contextlib.contextmanager
def _fake_state(model: torch.nn.Module, device: torch.device, values: Values) -> Iterator[None]:
    """Swap the model's parameters and buffers for fake ones on ``device``, which ``values``
    knows stand for them; restore on exit.

    A tensor that two modules hold (tied weights) gets one fake, and tensors that share a
    storage get fake ones that share one too (Note [Fake weights share their buffer])."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    shared = _shared_storages(model)
    fakes: dict[int, Any] = {}
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if value is None:
                        continue
                    fake: Any = fakes.get(id(value))
                    if fake is None:
                        fake = _fake_like(value, device, shared)
                        if isinstance(value, torch.nn.Parameter):
                            fake = torch.nn.Parameter(fake, requires_grad=value.requires_grad)
                        fakes[id(value)] = fake
                        values.know(fake, value)
                    saved.append((table, name, value))
                    table[name] = fake
        yield
    finally:
        for table, name, value in reversed(saved):
            table[name] = value
        for module in model.modules():
            if isinstance(module, torch.nn.RNNBase):
                module._init_flat_weights()  # its list of weights held the fake ones


# Note: [A module's cache is put back]
# A module may keep a tensor its forward made in an attribute: MONAI's DynUNet hands its
# deep-supervision heads to its decoder in a list its blocks fill, and a module may cache a mask
# or a table it made once. Traced, it keeps a fake tensor there, which the real step would then
# take. So for a real model the trace remembers each module's own attributes (not those every
# module has) and the lists and dicts they hold, and where one holds a fake tensor after the step,
# puts back what it held before: a list or dict refilled in place (its holders share it), an
# attribute made meanwhile dropped. The real step makes its own again, as it did the first time.
# The same holds for the step function's globals, the variables it closes over and, for a
# method, its object's attributes, where the step binds them anew (a recurrent state carried from
# step to step, ``state = h.detach()``): a name bound to a fake tensor after the step is bound
# again to what it was before. What holds a fake tensor elsewhere (a GradScaler's scale) is
# refused (`_check_left`).
_EVERY_MODULES = frozenset(vars(torch.nn.Module()))
"""Attributes every module has (its parameters, buffers, submodules, hooks, mode)."""


def _holds_fake(value: object) -> bool:
    return any(isinstance(leaf, FakeTensor) for leaf in tree_flatten(value)[0])


@contextlib.contextmanager
def _module_caches_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put back what the model's modules held in their own attributes where the step left a fake
    tensor there (Note [A module's cache is put back])."""
    kept = []
    for module in model.modules():
        before = {k: v for k, v in vars(module).items() if k not in _EVERY_MODULES}
        held = {id(v): (v, copy.copy(v)) for v in before.values() if isinstance(v, (list, dict))}
        kept.append((module, before, held))
    try:
        yield
    finally:
        for module, before, held in kept:
            attributes = vars(module)
            _put_back(attributes, before, [k for k in attributes if k not in _EVERY_MODULES])
            for container, contents in held.values():
                if not _holds_fake(container):
                    continue
                if isinstance(container, list):
                    container[:] = contents
                else:
                    container.clear()
                    container.update(contents)


def _put_back(table: dict[str, Any], before: dict[str, Any], keys: list[str]) -> None:
    """Of ``keys``, bind those that hold a fake tensor in ``table`` again to what ``before``
    held, or drop them where it held none (Note [A module's cache is put back])."""
    for key in keys:
        if _holds_fake(table[key]):
            if key in before:
                table[key] = before[key]
            else:
                del table[key]


@contextlib.contextmanager
def _step_variables_kept(step: Callable[..., Any]) -> Iterator[None]:
    """Bind again the step function's globals, closed-over variables and, for a method, its
    object's attributes that the step bound to a fake tensor (Note [A module's cache is put
    back])."""
    function: Any = step
    while isinstance(function, functools.partial):
        function = function.func
    owner = getattr(function, "__self__", None)  # a bound method's object
    function = getattr(function, "__func__", function)
    tables = [getattr(function, "__globals__", None)]
    if owner is not None and not isinstance(owner, torch.nn.Module):  # modules: their caches
        tables.append(getattr(owner, "__dict__", None))
    kept = [(table, dict(table)) for table in tables if isinstance(table, dict)]
    cells = getattr(function, "__closure__", None) or ()
    contents = [_content(cell) for cell in cells]
    try:
        yield
    finally:
        for table, before in kept:
            _put_back(table, before, [k for k, v in table.items() if v is not before.get(k)])
        for cell, content in zip(cells, contents, strict=True):
            now = _content(cell)
            if now is not content and _holds_fake(now):
                if content is _UNBOUND:
                    del cell.cell_contents
                else:
                    cell.cell_contents = content


_UNBOUND = object()


def _content(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a variable not yet bound
        return _UNBOUND


class _MetaFailures(logging.Filter):
    """Drops fake tensors' log of a shape check that failed (Note [A failed shape check is
    told once])."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def meta_failures_told_once() -> Iterator[None]:
    """Note: [A failed shape check is told once]
    An op whose shapes do not fit (a pooling window larger than its input, at a size the model
    was not made for) fails in its meta kernel, and fake tensors log the whole traceback at
    error level before raising. The trace turns that exception into its own error, which names
    it and the fix, so the log would tell the user the same thing twice, the first time at
    length. It is dropped while the step is traced, and only that message."""
    quiet = _MetaFailures()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addFilter(quiet)
    try:
        yield
    finally:
        fake_log.removeFilter(quiet)


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """Every object made before the block frozen out of garbage collection within it.

    Note: [A trace collects only its own garbage]
    A trace makes hundreds of thousands of Python objects (fake tensors, their metadata, the
    recorder's records), so the interpreter collects often, and each full collection walks every
    object alive: PyTorch's and the model library's too. Frozen first (`gc.freeze`), the objects
    made before the step are not walked, nor by the collection the trace makes before it reads
    what the step left held. Garbage that passes through a frozen object stays until a later
    collection: the check for fake tensors left behind (`_check_left`) runs after `gc.unfreeze`.
    A caller that froze objects itself is left as it is. Timings:
    benchmarks/results/README.md, "Planning time for language models".
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """The process's random generators as they were before the block, after it.

    Note: [A trace leaves the random generators as it found them]
    The step's Python code runs for real while its tensors are fake: a model that draws from
    Python's `random` or numpy's global generator (masks of time steps in speech models, layers
    dropped at random, the step's own augmentations) draws there as it traces, and so does
    building a model for real, from PyTorch's generator. A tune between seeding and the first
    step would then give that step other draws than the same step without it. The trace puts
    back the state of PyTorch's CPU generator, of every CUDA generator already made, of
    `random` and of numpy's global generator.
    """
    cuda = torch.cuda.is_initialized()
    states = (
        random.getstate(),
        numpy.random.get_state(),
        torch.random.get_rng_state(),
        torch.cuda.get_rng_state_all() if cuda else None,
    )
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


# Long by design: one traced step, read top to bottom: checks, the fake model and batch, the
# step under the recorder, and the errors it turns into typed ones; its parts share the fake
# mode's context, which helpers would have to thread through.
@_random_states_kept()
def trace_step(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any,
    step_fn: StepFn | None = None,
    *,
    device: str | torch.device | None = None,
    autocast: torch.dtype | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    min_offload_bytes: int = AUTO_MIN_OFFLOAD_BYTES,
    name: str = "model",
    slabs: Mapping[str, int] | None = None,
    max_ops: int | None = None,
    card_kernels: bool = False,
) -> Trace:
    """Run one training step under `FakeTensorMode` and record it.

    Args:
        model: a module (its real parameters are swapped for fake ones while tracing and put
            back after), or a function that builds one (called under fake tensors on ``device``;
            for real on the CPU where its own code reads a tensor's value).
        batch: the step's input tensors (a tensor, or a list, tuple or dict of them, nested as the
            step expects), or a function that makes them (under fake tensors).
        step_fn: ``step_fn(model, batch)`` runs forward, loss and backward; default:
            `default_step`.
        device: the device to pretend; default CUDA when there is one, else the CPU.
        autocast: run the step under autocast to this dtype (``torch.bfloat16``, ``torch.float16``).
        optimizer: builds an optimizer over the parameters; its ``step()`` then ends the step.
        min_offload_bytes: saved tensors below this stay on the device (as in `lms.LMS`).
        name: the name reports give the model.
        slabs: submodules that run in slabs along their first spatial dimension, by name, with
            how many (`lms.core.slabs.split_modules`).
        max_ops: with ``slabs``, the most ops the step may run in them: past it the trace
            stops (Note [Which submodules run in slabs]).
        card_kernels: on the CPU, run attention and dropout as a card's fused kernels do, for
            a step priced for a GPU (Note [A card's attention and dropout, traced on a CPU]).

    Raises:
        SplitError: a name in ``slabs`` is not a submodule, or a count is below 2; or the step
            in slabs ran past ``max_ops``.
        StepFailedError: the step raised under fake tensors (the model's own error, such as a
            batch norm over one value, or an op whose output shape depends on the data).
        UnplannableStepError: the step is not one forward and backward, or the model's
            parameters are sharded across processes.
        ValueError: ``device`` is a CUDA device and this machine has none.
    """
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if target.type == "cuda" and not torch.cuda.is_available():
        # Autograd's engine asks the driver for the device even when the tensors are fake.
        raise ValueError(
            f"lms: device={str(device)!r} but this machine has no CUDA device; trace on the CPU "
            "(device='cpu') and price the step for a GPU with a device spec, as lms.analyze("
            "..., device_spec='h100') and lms analyze --device-spec do"
        )
    step = step_fn or default_step
    # Real tensors the step takes from outside (a GradScaler's scale, a frozen teacher model's
    # weights) are traced as fake copies of themselves.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = Values()  # Note [A value the step reads is computed for real]
    recorder = Recorder(min_offload_bytes, values, max_ops if slabs else None)
    built, real = _build(model, fake_mode, target)
    sharded = fsdp.units(built)
    _refuse_sharded(built, name, sharded)
    fake_state = _fake_state(built, target, values) if real else _noop()
    caches = _module_caches_kept(built) if real else _noop()
    with (
        _old_objects_frozen(),
        fsdp.hooks_lifted(built),
        caches,
        _step_variables_kept(step),
        CardKernels() if card_kernels and target.type == "cpu" else _noop(),
        fake_mode,
        torch.device(target),
        fake_state,
        split_modules(built, slabs or {}),
    ):
        given = batch() if callable(batch) else batch
        given_leaves, structure = _batch_leaves(given)
        # tensors of the batch that share a storage share a fake one (``labels=input_ids``)
        seen = collections.Counter(
            _storage_key(t) for t in given_leaves if isinstance(t, torch.Tensor)
        )
        shared: dict[tuple[str, int], torch.Tensor | None] = {
            key: None for key, count in seen.items() if key is not None and count > 1
        }
        # a batch tensor the step differentiates (a gradient penalty's, an adversarial input's)
        # keeps requiring a gradient
        leaves = [
            _fake_like(t, target, shared).requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor)
            else t
            for t in given_leaves
        ]
        inputs = tree_unflatten(leaves, structure)  # the batch's own structure, faked
        for given_leaf, leaf in zip(given_leaves, leaves, strict=True):
            if isinstance(given_leaf, torch.Tensor):
                values.know(leaf, given_leaf)
        # Note [A mask of ones is known as such]: the batch's tokens are read only for these
        hugging_face = _runs_hugging_face(built)
        checks = _mask_checks() if hugging_face else {}
        if hugging_face and not checks:  # a release before the checks
            inputs = _without_a_mask_of_ones(given, inputs)
        if _as_dict(given):
            inputs = _as(type(given), inputs)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        opt = optimizer(built.parameters()) if optimizer is not None else None
        input_shapes = tuple(tuple(t.shape) for t in tensors)
        param_bytes = recorder.register(iter(built.parameters()), "param")
        buffer_bytes = recorder.register(iter(built.buffers()), "buffer")
        input_bytes = recorder.register(iter(tensors), "input")
        amp = torch.autocast(target.type, dtype=autocast) if autocast is not None else _noop()
        hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)
        recorder.name_modules(built)
        root = type(built).__name__
        pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.enter_module)
        post = torch.nn.modules.module.register_module_forward_hook(
            recorder.exit_module, always_call=True
        )
        leave_modules()
        try:
            with (
                recorder,
                recorder.forward_nodes,
                hooks,
                _eager() as watch,
                _masks_of_ones_known(checks, given_leaves, leaves),
                _packing_read(hugging_face),
                _Padded(),
                meta_failures_told_once(),
            ):
                with amp:
                    result = step(built, inputs)
                if opt is not None:
                    opt.step()
        except LMSError:
            raise
        except OpsPastLimitError:
            raise SplitError(
                f"lms: {name}'s step in slabs ran past {max_ops} ops, the most it may; run "
                "these modules whole"
            ) from None
        except Exception as error:
            raise step_failed(error, f"{name}'s step, traced under fake tensors,") from error
        finally:
            pre.remove()
            post.remove()
            recorder.close()
        saves = sum(event.kind == "save" for event in recorder.events)
        if saves and not recorder.seen_backward:
            raise UnplannableStepError(
                f"lms: {name}'s step saved {saves} tensors for backward but ran no backward: "
                "the step function must run forward, the loss and its backward "
                "(loss.backward()), as a training step does"
            )
        del result
        # the batch's gradients, where the step asks for them, stay after it as the weights' do
        differentiated = [t for t in tensors if t.requires_grad]
        grads = [p.grad for p in [*built.parameters(), *differentiated] if p.grad is not None]
        gradient_ids = {recorder.storage_id(t)[0] for g in grads for t in dense_parts(g)}
        for leaf in differentiated:
            leaf.grad = None  # made under fake tensors: no real step may see it
        fsdp.resolve(sharded, recorder.storage_id)
        states = [v for s in (opt.state.values() if opt else ()) for v in s.values()]
        state_ids = {recorder.storage_id(v)[0] for v in states if isinstance(v, torch.Tensor)}
        del opt, grads, states, inputs, leaves, tensors, differentiated
        torch.clear_autocast_cache()  # its casts of the fake weights, under a caller's autocast
        gc.collect()
    backward_start = next(
        (op.index for op in recorder.ops if op.phase == "backward"), len(recorder.ops)
    )
    storages = fsdp.account(
        recorder.storage_records(gradient_ids, state_ids), tuple(recorder.ops), sharded, root
    )
    param_bytes -= sum(whole - shard for unit in sharded for _, _, shard, whole in unit.params)
    trace = Trace(
        name=name,
        input_shapes=input_shapes,
        device=str(target),
        ops=tuple(recorder.ops),
        calls=tuple(recorder.calls),
        modules=tuple(recorder.called),
        storages=tuple(storages),
        events=recorder.saved_events(),
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        gradient_bytes=sum(storages[s].nbytes for s in gradient_ids),
        state_bytes=sum(storages[s].nbytes for s in state_ids),
        backward_start_op=backward_start,
        num_levels=max(recorder.op_level, default=0),
        num_edges=recorder.edges,
        min_offload_bytes=min_offload_bytes,
        junctions=tuple(sorted(recorder.joined, key=lambda j: j.storage)),
        compiled=watch.entered
        or _is_compiled(step)
        or any(_is_compiled(module) for module in built.modules()),
        slabs=tuple(sorted((slabs or {}).items())),
    )
    made = recorder.made
    del recorder, hooks, built, watch  # the recorder keeps forward's autograd nodes
    _check_left(made)
    return trace


def _check_left(made: list[Any]) -> None:
    """Refuse a step that left tensors it made under fake tensors in objects that outlive
    the trace: those objects would hand a real step a fake tensor.

    Raises:
        StepStateError: naming where each such tensor is held.
    """
    if not any(ref() is not None for ref in made):
        return
    gc.collect()  # what a reference cycle alone keeps
    left = [t for t in (ref() for ref in made) if t is not None]
    if not left:
        return
    holders = sorted({name for tensor in left for name in _holders(tensor)})
    shown = ", ".join(holders[:5]) or f"{len(left)} objects"
    raise StepStateError(
        f"lms: tracing the step left fake tensors in {shown}: the step made state while it ran "
        "under fake tensors (a GradScaler's scale, a tensor an object outside the model keeps), "
        "and those objects now hold tensors a real step cannot use. Make them again, then make "
        "their state before tune (run one real step first), or tune a step that leaves them out "
        "(for a GradScaler: loss.backward() with autocast=torch.float16; scaling the loss "
        "changes no memory)",
        holders=holders,
    )


def _holders(tensor: torch.Tensor) -> list[str]:
    """Where ``tensor`` is held: ``Type.attribute``, ``Type.table[key]`` for a tensor in a dict
    attribute (a module's buffers), ``module.name`` for a module's global, and ``...[i]`` for a
    tensor in a tuple or list held so (a recurrent state kept between steps)."""
    names = _names_of(tensor)
    for holder in gc.get_referrers(tensor):
        if isinstance(holder, (tuple, list)):
            index = next(i for i, value in enumerate(holder) if value is tensor)
            names += [f"{name}[{index}]" for name in _names_of(holder)]
    return names


def _owner(thing: object) -> str:
    return thing.__name__ if isinstance(thing, types.ModuleType) else type(thing).__name__


def _names_of(thing: object) -> list[str]:
    """Where ``thing`` is an attribute, or a value in a dict attribute."""
    names = []
    for table in gc.get_referrers(thing):
        if not isinstance(table, dict):  # an object whose attributes are not a dict of their own
            attributes = getattr(table, "__dict__", None)
            if isinstance(attributes, dict):
                names += [
                    f"{_owner(table)}.{key}" for key, value in attributes.items() if value is thing
                ]
            continue
        keys = [str(key) for key, value in table.items() if value is thing]
        for owner in gc.get_referrers(table):
            if getattr(owner, "__dict__", None) is table:
                names += [f"{_owner(owner)}.{key}" for key in keys]
            elif isinstance(owner, dict):
                outer = [str(k) for k, v in owner.items() if v is table]
                for holder in gc.get_referrers(owner):
                    if getattr(holder, "__dict__", None) is owner:
                        names += [
                            f"{_owner(holder)}.{name}[{key!r}]" for name in outer for key in keys
                        ]
    return names


def _is_compiled(thing: torch.nn.Module | Callable[..., Any]) -> bool:
    """Whether ``thing`` is compiled with ``torch.compile``: a module compiled in place
    (``module.compile()``), one that wraps a compiled one, one whose ``forward`` was replaced by
    a compiled function, or a compiled function (such as a whole step)."""
    if isinstance(thing, torch.nn.Module):
        if getattr(thing, "_compiled_call_impl", None) is not None:
            return True
        if type(thing).__name__ == "OptimizedModule":
            return True
        thing = thing.forward
    # What torch.compile returns keeps the original here; torch.compiler.disable's wrappers too,
    # marked as disabled.
    return getattr(thing, "_torchdynamo_orig_callable", None) is not None and not getattr(
        thing, "_torchdynamo_disable", False
    )


class _Watch:
    """What `_eager` saw: whether the step entered a compiled function."""

    entered = False


@functools.cache
def _compiled_entry() -> types.CodeType | None:
    """The code every function `torch.compile` returns runs first (a module compiled in place
    or wrapped calls one too); None where torch.compile is not available.

    The code is read from dynamo's context, where it is defined, without compiling anything:
    the first `torch.compile` of a process takes about a second. Where dynamo defines it
    elsewhere, one function is compiled to find it."""
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except Exception:  # an interpreter torch.compile does not support
        return None
    call = getattr(_TorchDynamoContext.__call__, "__code__", None)
    for constant in call.co_consts if call is not None else ():
        if isinstance(constant, types.CodeType) and constant.co_name == "compile_wrapper":
            return constant
    try:
        wrapper = torch.compile(_identity)
    except Exception:
        return None
    return getattr(wrapper, "__code__", None)


def _identity(value: Any) -> Any:
    return value


@contextlib.contextmanager
def _eager() -> Iterator[_Watch]:
    """Compiled functions run eagerly inside the trace, which watches for them.

    Note: [The trace leaves compiled code alone]
    Under PyTorch 2.11, calling a compiled step or forward under the trace's fake and dispatch
    modes left its frame running eagerly ever after: the user's compiled steps lost inductor's
    kernels (and its rounding) once tuned. Forcing eager here keeps dynamo's caches as they were.

    A compiled function anywhere in the step (one a module's forward calls, however deep) is seen
    entering: a profile function (this thread's, for the trace only, removed at the first one)
    waits for the code of torch.compile's wrapper. `torch.compiler.disable`'s wrappers run other
    code. Under a profiler already installed (cProfile), only what `_is_compiled` finds is seen.
    """
    watch = _Watch()
    entry = _compiled_entry()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is entry:
            watch.entered = True
            sys.setprofile(None)

    install = entry is not None and sys.getprofile() is None
    with torch.compiler.set_stance("force_eager"):
        if install:
            sys.setprofile(profile)
        try:
            yield watch
        finally:
            if install:
                sys.setprofile(None)


@contextlib.contextmanager
def _noop() -> Iterator[None]:
    yield
