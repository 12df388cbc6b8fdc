"""Trace one training step under fake tensors: every op, storage and saved-tensor event.

No real memory is used: parameters, inputs and every intermediate are `FakeTensor`s, so a step that
needs 90 GiB on a GPU traces in seconds on a small CPU machine.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from lms.analysis.records import JunctionRecord, OpRecord, SavedEvent, StorageRecord, Trace
from lms.config import AUTO_MIN_OFFLOAD_BYTES
from lms.errors import LMSError, step_failed
from lms.runtime import junctions

__all__ = ["trace_step", "default_step", "StepFn"]

StepFn = Callable[[torch.nn.Module, Any], Any]
_SKIP_OPS = {"aten.detach.default", "aten.alias.default", "prim.device.default"}


def default_step(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Forward, a mean over the output as the loss, backward. Returns the loss."""
    out = model(*batch)
    if isinstance(out, Mapping):
        out = out["out"] if "out" in out else next(iter(out.values()))
    if hasattr(out, "logits"):
        out = out.logits
    loss = out.float().mean()
    loss.backward()
    return loss


class _Recorder(TorchDispatchMode):
    """Records every aten op, storage allocation and free, and saved-tensor event."""

    def __init__(self, tracker: ModTracker, min_offload_bytes: int):
        super().__init__()
        self.tracker = tracker
        self.min_offload_bytes = min_offload_bytes
        self.ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refs: dict[int, weakref.ref[Any]] = {}
        self.nbytes: list[int] = []
        self.kind: list[str] = []
        self.alloc_op: list[int] = []
        self.free_op: list[int | None] = []
        self.last_forward: list[int] = []
        self.writer: dict[int, int] = {}
        self.ops: list[OpRecord] = []
        self.op_level: list[int] = []
        self.edges = 0
        self.events: list[SavedEvent] = []
        self.level = 0
        self.fixed: set[int] = set()
        self.seen_backward = False
        self.names: dict[int, str] = {}
        self.stack: list[str] = []
        self.marks: list[int] = []  # the last autograd node number before each module ran
        self.edge_of: dict[int, junctions.Edge] = {}  # storage: edge when first saved
        self.walked = False
        self.forward_nodes = _ForwardNodes()
        self.saved_nodes: list[Any] = []  # grad_fn of each tensor forward saved
        self.arrivals: dict[int, list[tuple[int, int, int]]] = {}
        self.joined: list[JunctionRecord] = []
        self.meeting: dict[Any, int] = {}  # junction: how many partials meet there

    # -- modules -----------------------------------------------------------------------------
    def name_modules(self, model: torch.nn.Module) -> None:
        root = type(model).__name__
        for name, module in model.named_modules():
            self.names[id(module)] = f"{root}.{name}" if name else root

    def enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))
        self.marks.append(max(map(_sequence_nr, _nodes(args)), default=-1))

    def exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.stack:
            return
        name, mark = self.stack.pop(), self.marks.pop()
        if self.phase() != "forward":
            return
        # Note: [Name backward nodes by the module that made them]
        # Autograd numbers nodes in the order forward makes them. The nodes a module made are
        # those behind its outputs numbered after every node behind its inputs; inner modules
        # exit first and claim theirs. Backward then names an op by the node that runs it,
        # where module hooks cannot see a module whose inputs need no gradient (an embedding).
        todo = [node for node in _nodes(output) if _sequence_nr(node) > mark]
        while todo:
            node = todo.pop()
            if "lms_module" in node.metadata:
                continue
            node.metadata["lms_module"] = name
            for after, _ in node.next_functions:
                if after is not None and mark < _sequence_nr(after) < _NO_NUMBER:
                    todo.append(after)

    def module(self, phase: str) -> str:
        if phase == "forward":
            return self.stack[-1] if self.stack else "Global"
        node: Any = torch._C._current_autograd_node()
        if node is not None and "lms_module" in node.metadata:
            return str(node.metadata["lms_module"])
        parents = self.tracker.parents
        return max(parents, key=len) if parents else "Global"

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
        if torch._C._current_graph_task_id() != -1:
            self.seen_backward = True
            return "backward"
        return "optimizer" if self.seen_backward else "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if name in _SKIP_OPS:
            return out
        index = len(self.ops)
        phase = self.phase()
        inputs: dict[int, int] = {}
        for arg in tree_flatten((args, kwargs))[0]:
            if isinstance(arg, torch.Tensor):
                sid, _ = self.storage_id(arg)
                inputs[sid] = self.nbytes[sid]
        outputs: dict[int, int] = {}
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                sid, new = self.storage_id(value)
                if new or sid in inputs and _writes_inplace(func):
                    outputs[sid] = self.nbytes[sid]
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
            )
        )
        self.op_level.append(level)
        return out

    # -- saved tensors -----------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.level += 1
        if not self.walked and tensor.grad_fn is not None:
            self.saved_nodes.append(tensor.grad_fn)
        sid, _ = self.storage_id(tensor)
        base = tensor if tensor._base is None else tensor._base
        offloadable = not (
            sid in self.fixed
            or (base.is_leaf and base.requires_grad)  # a parameter, or a view of one
            or self.nbytes[sid] < max(self.min_offload_bytes, 1)
        )
        self.events.append(
            SavedEvent(self.level, len(self.ops), "save", sid, self.nbytes[sid], offloadable)
        )
        edge = junctions.edge_of(tensor) if offloadable and sid not in self.edge_of else None
        if edge is not None:
            self.edge_of[sid] = edge
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.walked and torch._C._current_graph_task_id() != -1:
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
        saved = next(e for e in reversed(self.events) if e.storage == sid and e.kind == "save")
        self.events.append(
            SavedEvent(self.level, len(self.ops), "use", sid, self.nbytes[sid], saved.offloadable)
        )
        return tensor

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


class _ForwardNodes(TorchFunctionMode):
    """Every autograd node forward makes: the ``grad_fn`` of each op's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() == -1:
            self.nodes.extend(_nodes(out))
        return out


_NO_NUMBER = 2**63  # AccumulateGrad and other nodes outside forward's numbering


def _sequence_nr(node: Any) -> int:
    return int(node._sequence_nr())


def _nodes(value: Any) -> list[Any]:
    """The autograd nodes that made the tensors in ``value``."""
    leaves = tree_flatten(value)[0]
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _writes_inplace(func: Any) -> bool:
    schema = func._schema
    return any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments)


@contextlib.contextmanager
def _fake_state(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Swap the model's parameters and buffers for fake ones on ``device``; restore on exit."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if value is None:
                        continue
                    fake: Any = torch.empty_strided(
                        value.shape, value.stride(), dtype=value.dtype, device=device
                    )
                    if isinstance(value, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=value.requires_grad)
                    saved.append((table, name, value))
                    table[name] = fake
        yield
    finally:
        for table, name, value in reversed(saved):
            table[name] = value


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
) -> Trace:
    """Run one training step under `FakeTensorMode` and record it.

    Args:
        model: a module (its real parameters are swapped for fake ones while tracing and put
            back after), or a function that builds one (called under fake tensors on ``device``).
        batch: the step's input tensors (a tensor, or a list, tuple or dict of them, nested as the
            step expects), or a function that makes them (under fake tensors).
        step_fn: ``step_fn(model, batch)`` runs forward, loss and backward; default:
            `default_step`.
        device: the device to pretend; default CUDA when there is one, else the CPU.
        autocast: run the step under autocast to this dtype (``torch.bfloat16``, ``torch.float16``).
        optimizer: builds an optimizer over the parameters; its ``step()`` then ends the step.
        min_offload_bytes: saved tensors below this stay on the device (as in `lms.LMS`).
        name: the name reports give the model.

    Raises:
        StepFailedError: the step raised under fake tensors (the model's own error, such as a
            batch norm over one value, or an op whose output shape depends on the data).
    """
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    step = step_fn or default_step
    tracker = ModTracker()
    recorder = _Recorder(tracker, min_offload_bytes)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode, torch.device(target):
        built = model() if callable(model) and not isinstance(model, torch.nn.Module) else model
        assert isinstance(built, torch.nn.Module)
        with _fake_state(built, target) if isinstance(model, torch.nn.Module) else _noop():
            leaves, structure = tree_flatten(batch() if callable(batch) else batch)
            leaves = [
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)
                if isinstance(t, torch.Tensor)
                else t
                for t in leaves
            ]
            inputs = tree_unflatten(leaves, structure)  # the batch's own structure, faked
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            opt = optimizer(built.parameters()) if optimizer is not None else None
            input_shapes = tuple(tuple(t.shape) for t in tensors)
            param_bytes = recorder.register(iter(built.parameters()), "param")
            buffer_bytes = recorder.register(iter(built.buffers()), "buffer")
            input_bytes = recorder.register(iter(tensors), "input")
            amp = torch.autocast(target.type, dtype=autocast) if autocast is not None else _noop()
            hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)
            recorder.name_modules(built)
            pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.enter_module)
            post = torch.nn.modules.module.register_module_forward_hook(
                recorder.exit_module, always_call=True
            )
            try:
                with tracker, recorder, recorder.forward_nodes, hooks:
                    with amp:
                        result = step(built, inputs)
                    if opt is not None:
                        opt.step()
            except LMSError:
                raise
            except Exception as error:
                raise step_failed(error, f"{name}'s step, traced under fake tensors,") from error
            finally:
                pre.remove()
                post.remove()
            del result
            grads = [p.grad for p in built.parameters() if p.grad is not None]
            gradient_ids = {recorder.storage_id(g)[0] for g in grads}
            state_ids: set[int] = set()
            if opt is not None:
                for state in opt.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            state_ids.add(recorder.storage_id(value)[0])
            del opt, grads, inputs, leaves, tensors
            gc.collect()
    backward_start = next(
        (op.index for op in recorder.ops if op.phase == "backward"), len(recorder.ops)
    )
    storages = []
    for sid, nbytes in enumerate(recorder.nbytes):
        kind = recorder.kind[sid]
        if sid in gradient_ids:
            kind = "gradient"
        elif sid in state_ids:
            kind = "state"
        storages.append(
            StorageRecord(
                id=sid,
                nbytes=nbytes,
                kind=kind,  # type: ignore[arg-type]
                alloc_op=recorder.alloc_op[sid],
                free_op=recorder.free_op[sid],
                last_forward_op=recorder.last_forward[sid],
            )
        )
    return Trace(
        name=name,
        input_shapes=input_shapes,
        device=str(target),
        ops=tuple(recorder.ops),
        storages=tuple(storages),
        events=tuple(recorder.events),
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
    )


@contextlib.contextmanager
def _noop() -> Iterator[None]:
    yield
