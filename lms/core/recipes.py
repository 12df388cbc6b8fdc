"""Which saved tensors backward could recompute instead of storing, and from what.

A saved storage can be recomputed when every forward op that wrote it is a deterministic op whose
replay gives the same bits (convolution, matrix product, normalisation, softmax, activation,
elementwise arithmetic, a reduction over dimensions, a cast, a concatenation), the
first of them returned it as its first output, and their other inputs are parameters, buffers,
other saved storages, storages made again the same way (Note [Remake what was never saved]), or
storages too small to offload (autocast's bf16 copy of a weight, which the runtime then holds for
the recipe): the runtime replays exactly those aten calls, so the
result is the same bits. Random ops (dropout's mask) and anything else are never replayed; a
product with a saved mask is. Whether a replay is worth it (a convolution costs far more than a
ReLU) is the planner's call, priced by the simulator.

An input of a recipe may itself be recomputed (a chain, as activation checkpointing replays a
block) when backward reads it no earlier than the storage it makes: the copy made for the chain
then serves its own first use too. Those inputs are the recipe's ``chainable`` ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lms.core.records import Trace

__all__ = ["RECOMPUTABLE_OPS", "Recipe", "recipes", "declared_writes", "written_arguments"]

_UNDECLARED_WRITES = {
    # Note: [Running statistics are written]
    # These kernels update the running mean and variance in place in training mode, but their
    # schemas do not mark those arguments as written. A replay must write copies of them, not
    # the buffers themselves, or each replay applies the momentum again.
    "aten.native_batch_norm.default": (3, 4),
    "aten.cudnn_batch_norm.default": (3, 4),
}
_DECLARED: dict[Any, tuple[tuple[int, str], ...]] = {}
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def declared_writes(func: Any) -> tuple[tuple[int, str], ...]:
    """The position and name of each argument an aten op's schema marks as written (in place,
    or ``out=``); looked up once a process."""
    found = _DECLARED.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        found = _DECLARED[func] = tuple(
            (i, a.name)
            for i, a in enumerate(arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return found


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """`declared_writes`, and the running statistics a batch norm writes though its schema does
    not say so (Note [Running statistics are written])."""
    found = _WRITTEN.get(func)
    if found is None:
        found = declared_writes(func)
        undeclared = _UNDECLARED_WRITES.get(str(func), ())
        if undeclared:
            names = [a.name for a in func._schema.arguments]
            found += tuple((i, names[i]) for i in undeclared if (i, names[i]) not in found)
        _WRITTEN[func] = found
    return found


_MAX_DEPTH = 5
"""How many storages deep a replay may remake storages that autograd did not save: GPT-2's
attention scores take a causal mask made four deep (``ones``, ``tril``, ``where``, the sum), its
tanh-approximated GELU a tanh four deep (``pow``, a scale, a sum, a scale)."""

RECOMPUTABLE_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "convolution.default",
        "native_batch_norm.default",
        "_native_batch_norm_legit.default",
        "_native_batch_norm_legit.no_stats",
        "_native_batch_norm_legit_no_training.default",
        "cudnn_batch_norm.default",
        "native_layer_norm.default",
        "native_group_norm.default",
        "relu.default",
        "relu_.default",
        "threshold.default",
        "threshold_.default",
        "hardtanh.default",
        "hardtanh_.default",
        "leaky_relu.default",
        "leaky_relu_.default",
        "gelu.default",
        "silu.default",
        "silu_.default",
        "sigmoid.default",
        "tanh.default",
        "add.Tensor",
        "add_.Tensor",
        "mul.Tensor",
        "mul_.Tensor",
        # a transformer's: its projections, attention scores and norms, its casts under autocast
        "mm.default",
        "addmm.default",
        "bmm.default",
        "baddbmm.default",
        "_softmax.default",
        "_log_softmax.default",
        "pow.Tensor_Scalar",
        "div.Tensor",
        "div.Scalar",
        "sub.Tensor",
        "rsub.Scalar",
        "mul.Scalar",
        "add.Scalar",
        "neg.default",
        "rsqrt.default",
        "sqrt.default",
        "exp.default",
        "cos.default",
        "sin.default",
        "tanh_.default",
        "sigmoid_.default",
        "gelu_.default",
        "mean.dim",
        "sum.dim_IntList",
        "_to_copy.default",
        "clone.default",
        "cat.default",
        "embedding.default",
        "masked_fill.Scalar",
        "where.self",
        # an attention's causal mask, made where forward runs, and its softmax in the math path
        "ones.default",
        "zeros.default",
        "full.default",
        "scalar_tensor.default",
        "arange.start",
        "tril.default",
        "triu.default",
        "_safe_softmax.default",
        # a 3D U-Net's decoder (MONAI's SegResNet, UNETR) and a mobile net's activations
        "upsample_nearest1d.default",
        "upsample_nearest2d.default",
        "upsample_nearest3d.default",
        "upsample_linear1d.default",
        "upsample_bilinear2d.default",
        "upsample_trilinear3d.default",
        "avg_pool2d.default",
        "avg_pool3d.default",
        "hardswish.default",
        "hardswish_.default",
        "mish.default",
        "elu.default",
    )
)
"""Ops whose output backward may recompute: deterministic, with no state but buffers."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to recompute one saved storage."""

    ops: tuple[int, ...]
    """Forward op indices that wrote it, in order: the first allocates it, the rest are in place."""
    inputs: tuple[int, ...]
    """Ordinals of the saved storages those ops read (parameters and buffers are not listed)."""
    chainable: tuple[int, ...] = ()
    """Those of ``inputs`` with a recipe of their own that backward first reads no earlier than
    this storage: a plan may recompute them too, as part of this one's replay."""
    scratch: tuple[int, ...] = ()
    """Storages autograd did not save that the replay makes on the way (Note [Remake what was
    never saved]), held until it ends."""
    scratch_ops: tuple[int, ...] = ()
    """The forward op indices that make ``scratch``, in the order they are replayed."""

    @property
    def all_ops(self) -> tuple[int, ...]:
        """Every forward op the replay runs: ``scratch_ops`` then ``ops``."""
        return self.scratch_ops + self.ops


@dataclasses.dataclass
class _Derived:
    """A recipe while it is found."""

    ops: tuple[int, ...]
    inputs: set[int] = dataclasses.field(default_factory=set)
    scratch: list[int] = dataclasses.field(default_factory=list)
    scratch_ops: list[int] = dataclasses.field(default_factory=list)

    def absorb(self, sub: _Derived, storage: int) -> None:
        """Make ``storage`` with ``sub`` first (once, however often it is read)."""
        if storage in self.scratch:
            return
        self.inputs |= sub.inputs
        self.scratch += [s for s in sub.scratch if s not in self.scratch] + [storage]
        self.scratch_ops += [k for k in (*sub.scratch_ops, *sub.ops) if k not in self.scratch_ops]


# Note: [A replay reads what its op read]
# A replay reads each saved input as the step has it in backward: where it stays on the device,
# as forward last wrote it. An op whose saved input forward writes again, in place, after the op
# read it would be replayed on other values and give other bits than forward made; such an op
# makes no recipe. The write may come as late as the op that saves the output: autograd clones a
# tensor an in-place op is about to change (a GRU cell's ``mul_`` on a chunk of its gates), and
# that op changes what the clone read. Only writes before the save were looked for once, and
# where the gates stayed, the replayed clone gave other bits and the gradients differed. An input
# autograd did not save is made again as it was when the op read it (Note [Remake what was never
# saved]).
def recipes(trace: Trace) -> dict[int, Recipe]:
    """For each saved storage (by ordinal) that backward could recompute, its recipe.

    Computed once per trace (Note [A trace derives once]); do not mutate it.
    """
    found = trace.memo.get("recipes")
    if found is None:
        found = trace.memo["recipes"] = _find(trace)
    return found  # type: ignore[no-any-return]


# Long by design: one walk over the trace's ops in order, whose state (what each storage's
# recipe is so far) every branch reads and writes.
def _find(trace: Trace) -> dict[int, Recipe]:
    # Note: [Compiled models are not replayed]
    # The runtime learns what forward wrote, to replay it, through a dispatch mode, and
    # torch.compile runs a frame eagerly while any dispatch mode is active: a plan that
    # recomputed would run a compiled model uncompiled, slower and with other rounding than the
    # compiled kernels. A compiled model's plan offloads instead.
    if trace.compiled:
        return {}
    # Note: [What backward saves again is not replayed]
    # A double backward saves again what its first backward read from forward's saves, and a
    # reentrant checkpoint its input: a copy brought back, which the runtime takes for a twin of
    # its entry (Note [A storage copied again keeps its place in the plan]) only under a plan
    # that replays nothing. Under one that replays, such a save would be a new entry, and the
    # step would leave its plan there. So a step that saves again in backward what was saved
    # before it is planned without replays: it offloads, and reads back per use.
    start = trace.backward_start_op
    if any(
        event.kind == "save"
        and event.op >= start
        and trace.storages[event.storage].alloc_op < start
        for event in trace.events
    ):
        return {}
    entries = trace.entries()
    ordinal_of = {storage: i for i, (storage, _, _) in enumerate(entries)}
    first_save = {storage: save_op for storage, _, save_op in entries}
    storages = {record.id: record for record in trace.storages}
    # Note: [A gathered weight is gone by backward]
    # FSDP gathers a layer's weights for its forward and frees them after it (a trace counts
    # that gathered rest as a storage of its own: `lms.analysis.fsdp.account`), and gathers
    # them again only for the layer's own backward, which runs after the ops that read what a
    # replay remakes. A replay of an op inside such a layer then read an emptied weight and
    # failed, or ran, where FSDP's prefetch had gathered it in time: on a loaded machine a
    # matter of timing. Such ops are not replayed; the plan offloads or keeps what they made.
    gathered = [
        (record.alloc_op, record.free_op)
        for record in trace.storages
        if record.kind == "param"
        and record.alloc_op >= 0
        and record.free_op is not None
        and record.free_op < (trace.backward_start_op or 0)
    ]
    writers: dict[int, list[int]] = {}
    for op in trace.ops:
        if op.phase == "forward":
            for storage in op.outputs:
                writers.setdefault(storage, []).append(op.index)

    def derive(
        storage: int, ops: list[int], save_op: int, outer: tuple[int, ...]
    ) -> _Derived | None:
        """How to remake ``storage`` by replaying ``ops`` (its writes, the first allocating
        it), reading saved storages no later than ``save_op`` or, within ``_MAX_DEPTH``,
        storages made again the same way; ``outer``: the storages that need this one."""
        if not ops or storages[storage].alloc_op != ops[0]:
            return None
        if trace.ops[ops[0]].outputs[0] != storage:  # the runtime replays the first output
            return None
        made = _Derived(tuple(ops))
        for index in ops:
            op = trace.ops[index]
            if op.name not in RECOMPUTABLE_OPS:
                return None
            if any(begin <= index <= end for begin, end in gathered) and any(
                storages[read].kind == "param" for read in op.inputs
            ):
                return None  # Note [A gathered weight is gone by backward]
            for read in op.inputs:
                if read == storage or storages[read].kind in ("param", "buffer"):
                    continue
                if read in outer:
                    return None  # a replay that would need itself
                if storages[read].nbytes < trace.min_offload_bytes and read not in op.outputs:
                    continue  # too small to offload (autocast's copy of a weight): held
                source = ordinal_of.get(read)
                if source is not None:
                    if any(w > index for w in writers.get(read, ())):
                        # Note [A replay reads what its op read]
                        return None
                    if first_save[read] <= save_op:
                        made.inputs.add(source)  # a saved storage, saved no later than this
                        continue
                # Note: [Remake what was never saved]
                # A storage autograd did not save (a residual block's shortcut, summed into
                # the block's output in place) is made again from what was, as it was when
                # this op read it: its writes before this op. The replay frees it at its end.
                earlier = [w for w in writers.get(read, ()) if w < index]
                deep = len(outer) >= _MAX_DEPTH
                sub = None if deep else derive(read, earlier, save_op, (*outer, storage))
                if sub is None:
                    return None
                made.absorb(sub, read)
        return made

    found: dict[int, Recipe] = {}
    for ordinal, (storage, _, save_op) in enumerate(entries):
        ops = writers.get(storage, [])
        if ops and ops[-1] < save_op:
            made = derive(storage, ops, save_op, ())
            if made is not None:
                found[ordinal] = Recipe(
                    made.ops,
                    tuple(sorted(made.inputs)),
                    scratch=tuple(made.scratch),
                    scratch_ops=tuple(made.scratch_ops),
                )
    first_use = trace.first_use_op()
    for ordinal, recipe in found.items():
        use = first_use.get(entries[ordinal][0])
        if use is None:
            continue
        chainable = tuple(
            source
            for source in recipe.inputs
            if source in found and first_use.get(entries[source][0], -1) >= use
        )
        if chainable:
            found[ordinal] = dataclasses.replace(recipe, chainable=chainable)
    return found
