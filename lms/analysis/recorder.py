"""What `lms.analysis.trace.trace_step` watches a step with: a dispatch mode that records each
aten op, storage and saved-tensor event, and the gradient junctions backward meets."""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from lms.analysis.values import Values
from lms.core import junctions
from lms.core.errors import UnplannableStepError
from lms.core.keep import offload_blocked, without_node
from lms.core.recipes import declared_writes
from lms.core.records import (
    JunctionRecord,
    OpCall,
    OpRecord,
    SavedEvent,
    StorageRecord,
    TensorMeta,
)

__all__ = ["OpsPastLimitError", "Recorder"]

SKIPPED_OPS = {"aten.detach.default", "aten.alias.default", "prim.device.default"}

# Note: [A fake tensor's device is asked for, not recorded]
# PyTorch's C++ asks a fake tensor for its device through the dispatcher (``prim.device``): its
# kernels, autograd and the attention's checks ask for it over and over, two thirds of the calls
# a Hugging Face GPT-2's step makes under fake tensors. It reads nothing and makes nothing, so the
# trace's modes pass it straight on, without the bookkeeping of an op (Note [A value the step
# reads is computed for real] included), which took a fifth of a trace's time.
DEVICE_QUERY = torch.ops.prim.device.default


class OpsPastLimitError(Exception):
    """The step ran more ops than its trace was allowed (`Recorder.max_ops`)."""


class Recorder(TorchDispatchMode):
    """Records every aten op, storage allocation and free, and saved-tensor event."""

    def __init__(
        self, min_offload_bytes: int, values: Values | None = None, max_ops: int | None = None
    ):
        super().__init__()
        self.min_offload_bytes = min_offload_bytes
        self.max_ops = max_ops
        self.values = values  # Note [A value the step reads is computed for real]
        self.ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refs: dict[int, weakref.ref[Any]] = {}
        self.nbytes: list[int] = []
        self.kind: list[str] = []
        self.alloc_op: list[int] = []
        self.free_op: list[int | None] = []
        self.last_forward: list[int] = []
        self.writer: dict[int, int] = {}
        self.ops: list[OpRecord] = []
        self.calls: list[OpCall | None] = []
        self.op_level: list[int] = []
        self.edges = 0
        self.events: list[SavedEvent] = []
        self.last_save: dict[int, SavedEvent] = {}  # by storage, its latest save event
        self.level = 0
        self.fixed: set[int] = set()
        self.seen_backward = False
        self.live_saves = 0  # saved tensors autograd still holds
        self.names: dict[int, str] = {}
        self.stack: list[str] = []
        self.called: dict[str, None] = {}  # the modules forward called, in order
        self.marks: list[int] = []  # the last autograd node number before each module ran
        self.backward_module = "Global"  # the module of the last named node backward ran
        self.edge_of: dict[int, junctions.Edge] = {}  # storage: edge when first saved
        self.walked = False
        self.forward_nodes = _ForwardNodes()
        self.saved_nodes: list[Any] = []  # grad_fn of each tensor forward saved
        self.arrivals: dict[int, list[tuple[int, int, int]]] = {}
        self.joined: list[JunctionRecord] = []
        self.meeting: dict[Any, int] = {}  # junction: how many partials meet there
        self.made: list[weakref.ref[torch.Tensor]] = []  # every fake tensor an op made
        # Note [Tensors the step's code holds]: when the last of forward's outputs of each
        # storage died
        self.let_go: dict[int, int] = {}
        # the tensors watched for when they die, each with the dict and key that keep it
        self.watched: list[tuple[dict[int, int], int, weakref.ref[torch.Tensor]]] = []
        # Note: [What backward makes and saves]
        # A double backward (`autograd.grad(create_graph=True)`: a gradient penalty, MAML)
        # saves, while its first backward runs, what that backward makes and what it read from
        # forward's saves, and reads them in the second. Moving one frees its device memory once
        # nothing but autograd's saves holds it, as in forward (Note [Tensors the step's code
        # holds]): so the trace watches the tensors each op makes after forward, and keeps when
        # the last of each storage died (`StorageRecord.last_held_op`). A copy read back lives
        # while the node that read it runs, not only for the op that first reads it: the trace
        # hands each read an alias of its own and watches it and the views made of it
        # (`SavedEvent.held_to`). The runtime finds a storage it brought back by its entry
        # (Note [A storage brought back is its entry's storage]), so that a save of it keeps
        # the plan's ordinals. An R1 penalty on an MLP, planned at 85% of its peak, measured
        # its simulated peak, bitwise: benchmarks/results/README.md, "A double backward under a
        # plan".
        self.made_late: set[int] = set()
        self.read_back: dict[int, int] = {}  # storage: index in events of its latest read
        self.read_held: dict[int, int] = {}  # read's index in events: when what it gave died
        self.packing = False
        self.late_let_go: dict[int, int] = {}

    def close(self) -> None:
        """Let go of the step's autograd nodes: the hooks on junctions call back here, and a
        cycle through a node's hooks is one Python's collector cannot see."""
        self.edge_of.clear()
        self.saved_nodes.clear()
        self.forward_nodes.nodes.clear()

    # -- modules -----------------------------------------------------------------------------
    def name_modules(self, model: torch.nn.Module) -> None:
        root = type(model).__name__
        for name, module in model.named_modules():
            self.names[id(module)] = f"{root}.{name}" if name else root

    def enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))
        if self.phase() == "forward":
            self.called[self.stack[-1]] = None
        self.marks.append(max(map(_sequence_nr, _nodes(args)), default=-1))

    def exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.stack:
            return
        name, mark = self.stack.pop(), self.marks.pop()
        if self.phase() == "optimizer":
            return
        # Note: [Name backward nodes by the module that made them]
        # Autograd numbers nodes in the order forward makes them. The nodes a module made are
        # those behind its outputs numbered after every node behind its inputs; inner modules
        # exit first and claim theirs. Backward then names an op by the node that runs it,
        # where module hooks cannot see a module whose inputs need no gradient (an embedding).
        # The walk goes on through an inner module's nodes without renaming them: behind them
        # lie this module's own ops from before it called the inner one (an attention's
        # product of queries and keys behind its output projection).
        todo = [node for node in _nodes(output) if _sequence_nr(node) > mark]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            number = _sequence_nr(node)
            if number in seen:
                continue
            seen.add(number)
            node.metadata.setdefault("lms_module", name)
            for after, _ in node.next_functions:
                if after is not None and mark < _sequence_nr(after) < _NO_NUMBER:
                    todo.append(after)

    def module(self, phase: str) -> str:
        if self.stack:  # forward, or a module that backward runs (a checkpoint's recomputation)
            return self.stack[-1]
        if phase == "forward":
            return "Global"
        # A node no module made (a parameter's AccumulateGrad) runs right after the node that
        # made its gradient and takes that node's module. No hooks on module inputs: those
        # would break `torch.autograd.grad` over a leaf that a module took (pytorch#131753).
        node: Any = torch._C._current_autograd_node()
        if node is not None and "lms_module" in node.metadata:
            self.backward_module = str(node.metadata["lms_module"])
        return self.backward_module

    # -- storages ----------------------------------------------------------------------------
    def storage_id(self, tensor: torch.Tensor, kind: str = "activation") -> tuple[int, bool]:
        storage = tensor.untyped_storage()
        known = self.ids.get(storage)
        if known is not None:
            return known, False
        sid = len(self.nbytes)
        self.ids[storage] = sid
        self.refs[sid] = weakref.ref(storage, self._freed(sid))
        self.nbytes.append(storage.nbytes())
        self.kind.append(kind)
        self.alloc_op.append(len(self.ops) if kind == "activation" else -1)
        self.free_op.append(None)
        self.last_forward.append(-1)
        return sid, True

    def _freed(self, sid: int) -> Callable[[Any], None]:
        def callback(_: Any) -> None:
            self.free_op[sid] = max(len(self.ops) - 1, self.alloc_op[sid])
            self.refs.pop(sid, None)

        return callback

    def _watch(self, into: dict[int, int], key: int, value: torch.Tensor) -> None:
        """Keep in ``into[key]`` the op after which ``value`` died, the latest of those so
        watched; the last op for one alive when the step ends (`_settle`)."""

        def died(_: Any) -> None:
            into[key] = max(into.get(key, -1), len(self.ops) - 1)

        self.watched.append((into, key, weakref.ref(value, died)))

    def _settle(self) -> None:
        """The watched tensors still alive: held to the step's last op."""
        last = len(self.ops) - 1
        for into, key, ref in self.watched:
            if ref() is not None:
                into[key] = last

    def _watch_late(self, value: torch.Tensor, sid: int, new: bool) -> None:
        """Watch ``value``, made after forward, for when it dies (Note [What backward makes and
        saves]): as a view of what a read gave, or of a storage made after forward."""
        read = self.read_back.get(sid)
        if read is not None:  # a view of what backward read: of the copy brought back
            self._watch(self.read_held, read, value)
        elif sid in self.made_late or (new and torch.is_grad_enabled()):  # what may be saved
            self.made_late.add(sid)
            self._watch(self.late_let_go, sid, value)

    def register(self, tensors: Iterator[torch.Tensor], kind: str) -> int:
        total = 0
        for tensor in tensors:
            sid, new = self.storage_id(tensor, kind)
            if new:
                total += self.nbytes[sid]
            if kind in ("param", "buffer"):
                self.fixed.add(sid)
        return total

    # -- ops ---------------------------------------------------------------------------------
    def phase(self) -> str:
        if junctions.in_backward():
            self.seen_backward = True
            return "backward"
        return "optimizer" if self.seen_backward else "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if func is DEVICE_QUERY:  # Note [A fake tensor's device is asked for, not recorded]
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if func is _CUDNN_RNN and args[3] is None:
            args = (*args[:3], _weight_buffer(args[1]), *args[4:])
        out: Any = None
        if func is _CUDNN_RNN_BACKWARD:
            out = _cudnn_rnn_grads(*args, **kwargs)
        elif func is _GROUPED_MM:
            out = _grouped_mm_on_cpu(args, kwargs)
        elif func is _CLONE and args[0].layout == torch.sparse_coo:
            out = _sparse_clone(args[0])
        if out is None and self.values is not None:
            out = self.values.call(func, args, kwargs)
        elif out is None:
            out = func(*args, **kwargs)
        taken = tensors_in((args, kwargs))
        returned = tensors_in(out)
        given = {id(t) for t in taken}
        # every new fake tensor an op made (not an in-place op's input); a real one (Note [A
        # packed sequence's batch sizes are real]) is one a real step can use
        self.made.extend(
            weakref.ref(t) for t in returned if id(t) not in given and isinstance(t, FakeTensor)
        )
        name = str(func)
        if name in SKIPPED_OPS:
            if (self.read_back or self.made_late) and not self.packing:
                for value in returned:  # a detached view of what backward made or read
                    if id(value) not in given:
                        self._watch_late(value, *self.storage_id(value))
            return out
        index = len(self.ops)
        if self.max_ops is not None and index >= self.max_ops:
            raise OpsPastLimitError
        phase = self.phase()
        inputs: dict[int, int] = {}
        for arg in taken:
            sid, _ = self.storage_id(arg)
            inputs[sid] = self.nbytes[sid]
        outputs: dict[int, int] = {}
        workspace = _workspace(func, args, kwargs, out)
        for value in returned:
            sid, new = self.storage_id(value)
            if new and workspace is not None and value is workspace[0]:
                self.nbytes[sid] = workspace[1]
            if new or sid in inputs and declared_writes(func):
                outputs[sid] = self.nbytes[sid]
            if phase == "forward" and id(value) not in given:
                self._watch(self.let_go, sid, value)
            elif phase != "forward" and id(value) not in given:
                self._watch_late(value, sid, new)
        level = 1
        for sid in inputs:
            producer = self.writer.get(sid)
            if producer is not None:
                self.edges += 1
                level = max(level, self.op_level[producer] + 1)
        for sid in outputs:
            self.writer[sid] = index
        if phase == "forward":
            for sid in list(inputs) + list(outputs):
                self.last_forward[sid] = index
        flops = 0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            try:
                flops = int(counter(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take this overload's arguments
                flops = 0
        module = self.module(phase)
        self.ops.append(
            OpRecord(
                index=index,
                name=name,
                module=module,
                phase=phase,  # type: ignore[arg-type]
                flops=flops,
                read_bytes=sum(inputs.values()),
                written_bytes=sum(outputs.values()),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                cpu_scratch_bytes=_cpu_scratch(name, args, out),
                touched_bytes=_touched_bytes(func, taken, returned),
            )
        )
        self.calls.append(_recorded_call(func, args, kwargs))
        self.op_level.append(level)
        return out

    # -- saved tensors -----------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Saved:
        if self.seen_backward and not self.live_saves and not junctions.in_backward():
            where = self.stack[-1] if self.stack else "the step function"
            raise UnplannableStepError(
                f"lms: the step runs forward again after its backward finished (a tensor saved "
                f"in {where}): a plan covers one forward and backward. Trace and enter the LMS "
                "block once per forward and backward (each micro-batch of gradient "
                "accumulation, each model's update), or let the runtime decide without a plan "
                "(LMS without tune, LMSCallback(tune=False))"
            )
        self.level += 1
        self.live_saves += 1
        if not self.walked and tensor.grad_fn is not None:
            self.saved_nodes.append(tensor.grad_fn)
        sid, _ = self.storage_id(tensor)
        base = tensor if tensor._base is None else tensor._base
        offloadable = not (
            sid in self.fixed
            or (base.is_leaf and base.requires_grad)  # a parameter, or a view of one
            or self.nbytes[sid] < max(self.min_offload_bytes, 1)
            or offload_blocked()  # as the runtime keeps it
        )
        event = SavedEvent(self.level, len(self.ops), "save", sid, self.nbytes[sid], offloadable)
        self.events.append(event)
        self.last_save[sid] = event
        edge = junctions.edge_of(tensor) if offloadable and sid not in self.edge_of else None
        if edge is not None:
            self.edge_of[sid] = edge
        self.packing = True  # the save's own alias holds nothing a step would
        try:
            return _Saved(tensor, self)
        finally:
            self.packing = False

    def unpack(self, saved: _Saved) -> torch.Tensor:
        tensor = saved.tensor
        if not self.walked and junctions.in_backward():
            self.walked = True
            root = torch._C._current_autograd_node()
            edges: dict[junctions.Edge, int] = {}
            for sid, edge in self.edge_of.items():
                edges.setdefault(edge, sid)
            consumers = junctions.fan_in(root, *self.forward_nodes.nodes)
            # The runtime cannot keep every forward node; it walks down from the saved tensors'
            # nodes and hooks only what it counts there. A junction it would miss is left out.
            seen = junctions.fan_in(root, *self.saved_nodes)
            self.forward_nodes.nodes.clear()
            self.saved_nodes.clear()
            visible = {
                edge: key
                for edge, key in edges.items()
                if len(seen.get(edge, ())) == len(consumers.get(edge, ()))
            }
            self.meeting = junctions.attach(
                visible, root, self.arrive, self.join, consumers=consumers
            )
        self.level += 1
        sid, _ = self.storage_id(tensor)
        save = self.last_save[sid]
        self.events.append(
            SavedEvent(self.level, len(self.ops), "use", sid, self.nbytes[sid], save.offloadable)
        )
        if not save.offloadable or not isinstance(tensor, FakeTensor):
            return tensor
        # an alias of its own, so that the trace sees when the node that read it lets it go
        read = len(self.events) - 1
        self.read_back[sid] = read
        self.read_held[read] = len(self.ops)
        alias = tensor.detach()
        self._watch(self.read_held, read, alias)
        return alias

    def saved_events(self) -> tuple[SavedEvent, ...]:
        """The saved-tensor events, each read with the op after which what it gave died."""
        self._settle()
        return tuple(
            dataclasses.replace(event, held_to=self.read_held[k]) if k in self.read_held else event
            for k, event in enumerate(self.events)
        )

    # -- gradient junctions: watched, left as the engine does them ---------------------------
    def arrive(self, key: Any, partial: torch.Tensor, last: bool) -> torch.Tensor:
        sid, _ = self.storage_id(partial)
        self.arrivals.setdefault(key, []).append((sid, self.nbytes[sid], len(self.ops)))
        return partial

    def join(self, key: Any, rest: torch.Tensor | None) -> None:
        arrived = self.arrivals.pop(key, [])
        if len(arrived) != self.meeting.get(key) or rest is None:
            return None  # a consumer that never ran: the runtime would take the last partial
        grads, sizes, arrive_ops = zip(*arrived, strict=True)
        merged, _ = self.storage_id(rest)
        # After the first, each partial is added to the others by the op right after it.
        made = [
            out
            for grad, index in zip(grads[1:], arrive_ops[1:], strict=True)
            if index < len(self.ops) and grad in self.ops[index].inputs
            for out in self.ops[index].outputs
        ]
        self.joined.append(
            JunctionRecord(
                key,
                grads,
                sizes,
                arrive_ops,
                len(self.ops),
                merged,
                tuple(sorted(set(made))),
                junctions.partials_taken(len(grads)),
            )
        )
        return None

    # -- result ------------------------------------------------------------------------------
    def storage_records(self, gradients: set[int], states: set[int]) -> list[StorageRecord]:
        """Every storage seen, by id; those in ``gradients`` and ``states`` named so."""
        # Note: [Tensors the step's code holds]
        # An offloaded or recomputed storage frees memory once autograd's save is all that holds
        # it. The step's code may hold it longer: a U-Net's forward keeps each block's output in
        # a local until it returns, a block its upsampled input until its convolutions have run.
        # The trace watches every tensor forward's ops return: a storage is in use until the last
        # of them dies (to the step's end for those still alive now), where the runtime's copy
        # frees it, not at its last read. The trace's saves hold aliases (Note [A kept save
        # holds no reference cycle]): what only autograd keeps, as max pooling's indices or an
        # RNN's workspace, dies with the code's last reference, as the runtime's copy frees it.
        self._settle()
        storages = []
        for sid, nbytes in enumerate(self.nbytes):
            kind = self.kind[sid]
            if sid in gradients:
                kind = "gradient"
            elif sid in states:
                kind = "state"
            storages.append(
                StorageRecord(
                    id=sid,
                    nbytes=nbytes,
                    kind=kind,  # type: ignore[arg-type]
                    alloc_op=self.alloc_op[sid],
                    free_op=self.free_op[sid],
                    last_forward_op=max(self.last_forward[sid], self.let_go.get(sid, -1)),
                    last_read_op=self.last_forward[sid],
                    last_held_op=self.late_let_go.get(sid, -1),
                )
            )
        return storages


# Note: [Workspaces fake tensors cannot size]
# The fused RNN kernels (oneDNN's LSTM layer on CPU, cuDNN's RNN on a GPU) return a workspace
# that autograd saves for backward: each step's gates, in a layout of the library's own. Their
# fake kernels give it zero bytes, so the trace would lose a saved tensor that the runtime sees,
# and with it the order by which a plan names saved tensors. The trace gives it an estimate: 64
# bytes per element of the output and layer for an LSTM (oneDNN made 61 to 63 from 50 steps on,
# and at most 18% more for shorter sequences), the gates' share of that for a GRU or plain RNN.
# The same estimate stands for cuDNN's reserve space.
_WORKSPACES = {"aten.mkldnn_rnn_layer.default": 3, "aten._cudnn_rnn.default": 3}
_GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # by cuDNN's mode: RNN_RELU, RNN_TANH, LSTM, GRU
_BYTES_PER_GATE = 16


def _recorded_call(func: Any, args: Any, kwargs: Any) -> OpCall | None:
    """The call, its tensors as their shapes; None where it cannot run alone: an op outside
    aten (a collective, a user's own op) or a tensor that is not a plain strided one."""
    if getattr(func, "namespace", None) != "aten":
        return None
    try:
        return OpCall(func, tuple(_as_meta(args)), dict(_as_meta(kwargs)))
    except _NotStrided:
        return None


class _NotStrided(Exception):
    """A tensor an op was given that a call of its own cannot make again."""


def _as_meta(value: Any) -> Any:
    """``value`` with each tensor in it (in lists, tuples and dicts, as aten's arguments hold
    them) replaced by its `TensorMeta`."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise _NotStrided
        return TensorMeta(tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device))
    if isinstance(value, (list, tuple)):
        items = [_as_meta(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {key: _as_meta(v) for key, v in value.items()}
    return value


# Note: [A sparse tensor is its parts]
# A sparse tensor (the gradient of an embedding made with sparse=True) has no storage of its own:
# its memory is that of its indices and its values, plain tensors. The trace counts those as what
# the op that makes it writes and what the op that takes it reads, and, where it is a weight's
# gradient, as the gradient the step leaves. Fake tensors clone a sparse tensor into one of no
# elements, so the trace clones its parts instead.
def dense_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold ``tensor``'s memory: itself, or a sparse tensor's indices
    and values (Note [A sparse tensor is its parts])."""
    if tensor.layout == torch.strided:
        return (tensor,)
    if tensor.layout == torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, in order: a walk of the lists, tuples and
    dicts that aten's calls hold, without pytree's general machinery, which the tracer would
    otherwise spend a sixth of its time in."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.layout is torch.strided:
                found.append(item)
            else:  # Note [A sparse tensor is its parts]
                found.extend(dense_parts(item))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def _workspace(func: Any, args: Any, kwargs: Any, out: Any) -> tuple[torch.Tensor, int] | None:
    """The workspace output of a fused RNN call that fake tensors gave no bytes, and its
    estimated bytes (Note [Workspaces fake tensors cannot size])."""
    position = _WORKSPACES.get(str(func))
    if position is None or out[position].untyped_storage().nbytes() > 0:
        return None
    named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    if not named.get("train", True):
        return None
    layers = 1 if "mkldnn" in str(func) else int(named.get("num_layers", 1))
    gates = _GATES.get(int(named.get("mode", 2)), 4)
    return out[position], _BYTES_PER_GATE * gates * out[0].numel() * layers


_GROUPED_MM = torch.ops.aten._grouped_mm.default if hasattr(torch.ops.aten, "_grouped_mm") else None


def _grouped_mm_on_cpu(
    args: Any, kwargs: Any, devices: tuple[str, ...] = ("cpu",)
) -> torch.Tensor | None:
    """A grouped matrix product in single or double precision on the CPU, under fake tensors.

    Note: [Grouped products the CPU takes in single precision]
    Mixture-of-experts layers (Hugging Face's Qwen2-MoE, Mixtral, ...) multiply each expert's
    tokens by its weights in one `torch._grouped_mm`. Its fake kernel follows the CUDA kernel's
    checks and refuses anything but bfloat16 and float16, while the CPU kernel also takes float32
    and float64: traced on the CPU, such a model's float32 step would fail where it runs. For those
    calls alone the output is made as the fake kernel makes it (the same shape rules, through
    PyTorch's own helper), in the dtype asked for; None for any other call, or where this PyTorch
    lacks the helper, which the fake kernel then gets. ``devices``: where the CPU's rules hold
    (the meta device too, where a model is only probed for its output's shape)."""
    if len(args) < 2:
        return None
    mat_a, mat_b = args[0], args[1]
    # a probe's weights are the model's own, real, beside fake activations
    if not (isinstance(mat_a, FakeTensor) or isinstance(mat_b, FakeTensor)):
        return None
    if mat_a.device.type not in devices or mat_a.dtype not in (torch.float32, torch.float64):
        return None
    try:
        from torch._meta_registrations import _create_grouped_mm_output_tensor
    except ImportError:
        return None
    named = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args, strict=False))
    named |= kwargs
    offs, out_dtype = named.get("offs"), named.get("out_dtype") or mat_a.dtype
    if offs is None and (mat_a.dim() == 2 or mat_b.dim() == 2):
        return None
    made: torch.Tensor = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
    return made


class CpuKernelShapes(TorchDispatchMode):
    """Under fake tensors (entered within their mode), the ops whose fake kernel refuses what the
    CPU's takes are given outputs by the CPU's rules, on the CPU or the meta device (Note
    [Grouped products the CPU takes in single precision]), and with ``values``, an op that reads
    a value (a layer dropped at random: ``torch.rand([]) < p``) is answered from the real ones
    where it can be (Note [A value the step reads is computed for real]): for a model probed for
    its output's shape, as the recorder does for a traced step."""

    def __init__(self, values: Values | None = None) -> None:
        super().__init__()
        self.values = values

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM:
            out = _grouped_mm_on_cpu(args, kwargs, devices=("cpu", "meta"))
            if out is not None:
                return out
        if self.values is not None:
            return self.values.call(func, args, kwargs)
        return func(*args, **kwargs)


_CUDNN_RNN = torch.ops.aten._cudnn_rnn.default
_CLONE = torch.ops.aten.clone.default


def _sparse_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a sparse tensor, under fake tensors: their clone keeps no element
    (Note [A sparse tensor is its parts]), where autograd clones a weight's sparse gradient."""
    return torch.sparse_coo_tensor(
        tensor._indices().clone(),
        tensor._values().clone(),
        tensor.shape,
        is_coalesced=tensor.is_coalesced(),
        check_invariants=False,
    )


_CUDNN_RNN_BACKWARD = torch.ops.aten._cudnn_rnn_backward.default


def _cudnn_rnn_grads(*args: Any, **kwargs: Any) -> tuple[Any, ...] | None:
    """cuDNN's RNN backward under fake tensors, which PyTorch gives no fake kernel: gradients of
    the input, the first hidden and cell states and the weights, each shaped as what it is the
    gradient of, where ``output_mask`` asks for it. None where the arguments are not fake."""
    named = dict(zip((a.name for a in _CUDNN_RNN_BACKWARD._schema.arguments), args, strict=False))
    named |= kwargs
    if not isinstance(named["input"], FakeTensor):
        return None
    wanted = list(named["output_mask"])

    def like(tensor: torch.Tensor | None, want: bool) -> torch.Tensor | None:
        return torch.empty_like(tensor) if want and tensor is not None else None

    weights = [torch.empty_like(w) for w in named["weight"]] if wanted[3] else []
    grads = [
        like(named[name], want) for name, want in zip(("input", "hx", "cx"), wanted, strict=False)
    ]
    return (*grads, weights)


def _weight_buffer(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weight buffer cuDNN's RNN call takes, which the fake call cannot find: a flat view of
    the storage the weights lie in one after another (after ``flatten_parameters``; Note [Fake
    weights share their buffer]), else a new buffer, as the real call makes and copies them into.

    The real call finds the buffer by comparing the weights' addresses, which fake tensors do not
    have, and without one the fake call gives backward none, which fails."""
    first = weights[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    end = start
    for weight in weights:
        if (
            weight.untyped_storage()._cdata != storage._cdata
            or weight.storage_offset() != end
            or not weight.is_contiguous()
        ):
            total = sum(w.numel() for w in weights)
            return torch.empty(total, dtype=first.dtype, device=first.device)
        end += weight.numel()
    return first.as_strided((end - start,), (1,), start)


# Note: [Convolution scratch on the CPU]
# A convolution on a CPU takes memory for itself while it runs, on top of its tensors, which fake
# tensors do not show. How much depends on the kernel PyTorch picks for it, which
# `torch._C._select_conv_backend` tells from the tensors' shapes, layout and dtype. oneDNN copies
# the weights into its blocked layout (and in backward makes their gradient there), copies
# activations in the contiguous layout in and the results back (forward: its input, where it has a
# block of channels or more or the kernel is pointwise, beside its output made blocked, then copied
# out; a strided backward in
# single precision: twice its input, or half as much again as its output gradient where that is
# more, and without an input gradient its output gradient beside its input), and in half
# precision keeps a weight gradient's operands in single precision (but a first layer's of fewer
# channels than a block; a pointwise one beside its input gradient, at least three times its
# input; in 3D, the input with its padding in depth), and a pointwise forward its input as a
# whole block of channels; the native kernels kept for small convolutions unfold the input into
# columns, one per kernel tap (but a pointwise forward at stride 1 without padding, which reads
# its input as they), and take their activations contiguous (an input in the channels-last
# layout is copied, and in backward its output gradient too: a 3D U-Net's upsampling of few
# channels). `_cpu_scratch` estimates each of these from the op's tensors, channels counted up to a
# whole block of `_CHANNEL_BLOCK`. A convolution runs in the channels-last layout where its input
# or its weight is in it, and copies an input that is not (an instance norm's output, which comes
# contiguous) into it first; backward likewise copies an output gradient laid out otherwise than
# the convolution runs (the gradient of a mean over channels, which comes contiguous). A depthwise
# convolution in the channels-last layout with a kernel wider than 3 (EfficientNet's and
# MobileNetV3's 5x5, ConvNeXt's 7x7) makes its weight gradient with each channel's single input and
# output counted up to a whole block, hundreds of times its own bytes (`_padded_depthwise`); in
# bfloat16 once more at half precision, beside one sample's activations so widened. A
# 3D convolution's single-precision weight gradient over an input of one or two frames, at a batch
# of two or more (a video ResNet's last stage at 16 frames), takes 4.2 to 4.8 times its weights for
# each thread (`_shallow_weight_grad`), where one of more frames takes about its weights. PyTorch
# runs a 1D convolution (a speech model's front end) as a 2D one over a single row, its input
# copied contiguous where it is not (Mamba's, transposed from the projection before it), and so
# it is estimated (`_one_row`); one with a kernel of 16 taps or more (wav2vec2's positional
# convolution, 128) makes its weight gradient in copies, as a 3D one over two frames does, each
# beside one group's input unfolded into columns. A
# dilated convolution whose kernel spans more than its input takes more than estimated, five
# times at DeepLabV3's atrous pooling; where a plan is tuned on the CPU it runs on, the timing
# process measures each op's scratch, and the simulator takes the larger (Note [An op's scratch,
# measured where it is timed] in `lms.orchestration.timing`). The simulator counts scratch for
# the "cpu" spec only (`DeviceSpec.cpu_scratch`). The sizes measured per kernel, and how close
# the estimates came: benchmarks/results/README.md, "Convolution scratch on the CPU".
_CONVOLUTIONS = {"aten.convolution.default", "aten.convolution_backward.default"}
_CHANNEL_BLOCK = 16


# Note: [An LSTM's backward scratch on the CPU]
# oneDNN's LSTM layer backward (`aten.mkldnn_rnn_layer_backward`) takes memory of its own while it
# runs: the gradients of the four gates at every step, in the output's dtype, and its two weight
# matrices' gradients in its own layout beside the ones it returns; four times the output's bytes
# plus twice the weights' came within 6% of what it took, over the shapes measured. A plain step's
# peak lies in forward and hides it, but once a plan moves what forward saves it can be the
# step's peak, which a trace without it put short of what the step took, and past its budget.
# Measurements: benchmarks/results/README.md, "An LSTM's backward scratch on the CPU".
_RNN_BACKWARD = "aten.mkldnn_rnn_layer_backward.default"
_GATES_PER_OUTPUT = 4


def _cpu_scratch(name: str, args: Any, out: Any) -> int:
    """Bytes a convolution (Note [Convolution scratch on the CPU]) or an LSTM layer's backward
    (Note [An LSTM's backward scratch on the CPU]) takes beyond its tensors on a CPU; 0 for any
    other op."""
    if name == _RNN_BACKWARD:
        given, output = args[0], args[7]
        if given.device.type != "cpu":
            return 0
        weights = sum(w.numel() * w.element_size() for w in args[1:3])
        return _GATES_PER_OUTPUT * output.numel() * output.element_size() + 2 * weights
    if name not in _CONVOLUTIONS:
        return 0
    backward = name.endswith("backward.default")
    grad_out, given, weight = args[:3] if backward else (out, args[0], args[1])
    if given.device.type != "cpu" or given.dim() not in (3, 4, 5):
        return 0
    if given.dim() == 3:  # PyTorch runs it as a 2D one of a single row, its input contiguous
        copied = 0 if given.is_contiguous() else given.numel() * given.element_size()
        return copied + _cpu_scratch(name, *_one_row(args, out, backward))
    settings = args[4:10] if backward else args[3:9]  # stride, padding, ..., groups
    transposed, groups = bool(settings[3]), settings[5]
    kernel = _backend(given, weight, *settings)
    if kernel.startswith("Slow"):
        taps = math.prod(weight.shape[2:])
        if transposed:
            columns = weight.size(1) * groups * taps * math.prod(given.shape[2:])
        elif backward or taps > 1 or any(step != 1 for step in settings[0]) or any(settings[1]):
            columns = given.size(1) * taps * math.prod(grad_out.shape[2:])
        else:  # a pointwise forward at stride 1 and no padding reads its input as its columns
            columns = 0
        # the native kernels take their activations contiguous: others are copied so first
        copied = [given, grad_out] if backward else [given]
        relaid = sum(t.numel() * t.element_size() for t in copied if not t.is_contiguous())
        return columns * given.size(0) * given.element_size() + relaid
    if not kernel.startswith("Mkldnn"):
        return 0
    # its weights in the blocked layout, and backward's weight gradient before it is copied out
    weights = weight.numel() * weight.element_size() * (2 if backward else 1)
    layout = torch.channels_last if given.dim() == 4 else torch.channels_last_3d
    pair = given, weight
    last = any(t.is_contiguous(memory_format=layout) and not t.is_contiguous() for t in pair)
    strided = any(step > 1 for step in settings[0])
    made = grad_out.numel() * grad_out.element_size()  # the output, or its gradient
    widened = _widened(given, grad_out, args, transposed or strided) if backward else 0
    # activations laid out otherwise than the convolution runs are copied into its layout first:
    # an output gradient in backward, and in the channels-last layout an input too
    runs_in = layout if last else torch.contiguous_format
    relayout = made if backward and not grad_out.is_contiguous(memory_format=runs_in) else 0
    if last and not given.is_contiguous(memory_format=layout):
        relayout += given.numel() * given.element_size()
    shallow = _shallow_weight_grad(given, weight, args) if backward and not transposed else 0
    if last:
        if backward:
            wide = 2 * made if strided and not transposed and args[10][0] else 0
            depthwise = _padded_depthwise(given, weight, grad_out, settings, args[10][1])
            if depthwise and given.dtype == torch.bfloat16:
                widened = 0  # its half-precision operands are counted there
            weights += depthwise
            rest = max(wide, widened) if strided or transposed else widened
            return max(weights + relayout + rest, shallow)
        return weights + relayout + (made if transposed else 0)
    pad = _blocked(given), _blocked(grad_out)
    pointwise = math.prod(weight.shape[2:]) == 1
    # the blocked input beside the output; one of fewer channels than a block is read as it is,
    # but by a pointwise kernel
    source = pad[0] if given.size(1) >= _CHANNEL_BLOCK or pointwise else 0
    if not backward:
        if transposed:
            return weights + 2 * pad[1]
        if pointwise and given.element_size() < 4:  # its output four or five times over
            few = grad_out.size(1) < _CHANNEL_BLOCK
            return weights + pad[0] + (5 if few else 4) * pad[1]  # its input as a whole block
        # the output made blocked, beside the input, then copied out into a tensor of its own
        # channels
        return weights + max(source + pad[1] - made, pad[1])
    input_grad = pad[0] if args[10][0] else 0
    if strided and not transposed and given.element_size() == 4:
        if input_grad:  # twice its input, or half as much again as its output gradient
            return max(weights + relayout + max(2 * pad[0], pad[1] * 3 // 2), shallow)
        return max(weights + relayout + pad[1] + source, shallow)
    if strided or transposed:
        return max(weights + relayout + pad[1] + pad[0] + max(input_grad, widened), shallow)
    if widened and not args[10][0] and pointwise:
        widened = 0  # a pointwise convolution's weight gradient alone: none
    elif widened and pointwise:
        # beside its input gradient, its input three times over where that is the more: a
        # segmentation head of many channels in and few out
        widened = max(widened, 3 * pad[0])
    return max(weights + relayout + pad[1] + max(pad[0], input_grad) + widened, shallow)


def _one_row(args: Any, out: Any, backward: bool) -> tuple[Any, Any]:
    """A 1D convolution's arguments and output as those of the 2D convolution over a single row
    that PyTorch runs in its place: each activation and the weight with a height of one (the
    input made contiguous first, so that a permuted one never runs channels-last), and each size
    in the settings led by that of the row."""
    tensors = 3 if backward else 2  # (output gradient,) input, weight
    given = 1 if backward else 0
    row = [(a.contiguous() if i == given else a).unsqueeze(2) for i, a in enumerate(args[:tensors])]
    first = 4 if backward else 3  # stride, padding, dilation, transposed, output padding
    lists = [[lead, *args[first + i]] for i, lead in ((0, 1), (1, 0), (2, 1))]
    settings = [*lists, args[first + 3], [0, *args[first + 4]], *args[first + 5 :]]
    middle = list(args[tensors:first])  # the bias, or its sizes
    return [*row, *middle, *settings], out if backward else out.unsqueeze(2)


def _padded_depthwise(
    given: torch.Tensor,
    weight: torch.Tensor,
    grad_out: torch.Tensor,
    settings: Any,
    weight_grad: bool,
) -> int:
    """Bytes of the weight gradient oneDNN makes for a depthwise convolution in the channels-last
    layout with a kernel wider than 3 (5x5, 7x7): each channel's single input and output counted
    up to a whole block of `_CHANNEL_BLOCK` each, `_CHANNEL_BLOCK` squared times its taps (a 3x3
    kernel's gradient is made as it is). In bfloat16, that gradient in single precision and again
    in half, and one sample's input (each spatial size grown by its padding once, not twice)
    and its output gradient with each channel counted up to a block, in half precision, whatever
    the batch and the threads. Measured in 2D on a CPU with AVX-512 BF16 and no AMX; 0 otherwise."""
    groups = settings[5]
    depthwise = groups > 1 and groups == given.size(1) == weight.size(0) and weight.size(1) == 1
    if not weight_grad or not depthwise or given.dim() != 4 or max(weight.shape[2:]) <= 3:
        return 0
    taps = math.prod(weight.shape[2:])
    padded = groups * _CHANNEL_BLOCK * _CHANNEL_BLOCK * taps
    if given.dtype == torch.float32:
        return padded * 4
    if given.dtype != torch.bfloat16:
        return 0
    padding = settings[1]
    pixels = math.prod(size + pad for size, pad in zip(given.shape[2:], padding, strict=True))
    pixels += math.prod(grad_out.shape[2:])
    return padded * (4 + 2) + groups * _CHANNEL_BLOCK * pixels * 2


_SHALLOW_DEPTH = 2
_SHALLOW_PER_THREAD = 4.8
_WIDE_ROW_TAPS = 16
_WIDE_ROW_SPLIT = 512


def _shallow_weight_grad(given: torch.Tensor, weight: torch.Tensor, args: Any) -> int:
    """Bytes oneDNN takes for the single-precision weight gradient of a 3D convolution over an
    input of at most `_SHALLOW_DEPTH` frames at a batch of two or more (a video network's last
    stage): `_SHALLOW_PER_THREAD` times its weights for each thread of the process. Over a single
    row with a kernel of `_WIDE_ROW_TAPS` taps or more (a 1D one of a speech model's positional
    embedding): four times its weights and one group's input unfolded into columns over the
    output's positions, once for each thread, at most one a sample, where those are at most
    `_WIDE_ROW_SPLIT`, else once (Note [Convolution scratch on the CPU]). 0 otherwise."""
    taps = math.prod(weight.shape[2:])
    wide_row = given.dim() == 4 and given.size(2) == 1 and taps >= _WIDE_ROW_TAPS
    if not (given.dim() == 5 or wide_row) or given.element_size() != 4 or not args[10][1]:
        return 0
    weights = weight.numel() * weight.element_size()
    threads = torch.get_num_threads()
    if wide_row:  # each copy its weights four times and one group's columns over the row
        positions = args[0].size(3)
        copy = 4 * weights + weight.size(1) * taps * positions * given.element_size()
        copies = min(threads, given.size(0)) if positions <= _WIDE_ROW_SPLIT else 1
        return copy * copies
    if given.size(2) > _SHALLOW_DEPTH or given.size(0) < 2:
        return 0
    return int(_SHALLOW_PER_THREAD * weights * threads)


def _widened(given: torch.Tensor, grad_out: torch.Tensor, args: Any, strided: bool) -> int:
    """Bytes a half-precision weight gradient on a CPU takes for its input and output gradient
    in single precision (Note [Convolution scratch on the CPU]); 0 in single precision, where no
    weight gradient is asked for, or for a first layer (no input gradient) of fewer input
    channels than a block."""
    first = not args[10][0]  # no input gradient: a first layer
    if given.element_size() >= 4 or not args[10][1] or (first and given.size(1) < _CHANNEL_BLOCK):
        return 0
    if strided:
        return given.numel() * given.element_size() + grad_out.numel() * grad_out.element_size()
    widened = _blocked(given)
    if given.dim() == 5:  # in 3D, the input with its padding in depth
        depth, pad = given.size(2), args[5][0]
        widened = widened * (depth + 2 * pad) // max(depth, 1)
    return 2 * (widened + _blocked(grad_out))


def _backend(given: torch.Tensor, weight: torch.Tensor, *settings: Any) -> str:
    """The name of the kernel PyTorch runs a convolution with ("Mkldnn", "Slow2d", ...)."""
    try:
        name = str(torch._C._select_conv_backend(given, weight, None, *settings, None).name)
    except (AttributeError, TypeError, RuntimeError):  # a PyTorch without it: the usual one
        return "Mkldnn"
    # PyTorch names each of its kernels in Python but oneDNN's transposed one ("???")
    return "MkldnnTranspose" if name == "???" and settings[3] else name


def _blocked(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` with its channels (dim 1) counted up to a whole block."""
    channels = tensor.size(1)
    blocked = -(-channels // _CHANNEL_BLOCK) * _CHANNEL_BLOCK
    return tensor.numel() * tensor.element_size() // max(channels, 1) * blocked


class _Saved:
    """What the trace hands autograd for a saved tensor; autograd drops it when it releases
    the save (after backward, unless the graph is retained)."""

    __slots__ = ("tensor", "recorder")

    def __init__(self, tensor: torch.Tensor, recorder: Recorder):
        # Note [A kept save holds no reference cycle]. A real tensor from outside the step (a
        # GradScaler's scale) stays itself: its alias, made under fake tensors, would be fake.
        self.tensor = without_node(tensor) if isinstance(tensor, FakeTensor) else tensor
        self.recorder = recorder

    def __del__(self) -> None:
        self.recorder.live_saves -= 1


class _ForwardNodes(TorchFunctionMode):
    """Every autograd node forward makes: the ``grad_fn`` of each op's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if not junctions.in_backward():
            self.nodes.extend(_nodes(out))
        return out


_NO_NUMBER = 2**63  # AccumulateGrad and other nodes outside forward's numbering


def _sequence_nr(node: Any) -> int:
    return int(node._sequence_nr())


def _nodes(value: Any) -> list[Any]:
    """The autograd nodes that made the tensors in ``value``."""
    return [t.grad_fn for t in tensors_in(value) if t.grad_fn is not None]


# Note: [An op moves its tensors, not their storages]
# Memory counts storages: a view keeps its whole storage resident. Time counts the elements an op
# reads and writes: a slice of a large storage costs its own elements, and a view op (a slice, a
# transpose, a split) moves nothing. Pricing memory-bound ops by their storages would charge a
# module run in slabs (Note [Slabs]) a whole tensor for every piece it reads.
def _touched_bytes(func: Any, taken: list[Any], returned: list[Any]) -> int:
    """The bytes of the tensors ``func`` reads and writes; 0 for a view op."""
    if getattr(func, "is_view", False):
        return 0
    total = 0
    tensors = [*{id(t): t for t in taken}.values(), *{id(t): t for t in returned}.values()]
    for tensor in tensors:
        try:
            own = tensor.numel() * tensor.element_size()
            total += min(own, tensor.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):  # no storage of its own (a sparse tensor)
            total += tensor.numel() * tensor.element_size()
    return total
