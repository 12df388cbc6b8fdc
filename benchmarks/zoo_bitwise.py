"""Bitwise check across architectures: small torchvision and MONAI models, an LSTM, an LSTM and a
bidirectional GRU over packed sequences of different lengths, and a Transformer encoder, each
run 3 steps with LMS against 3 plain steps, on the CPU (disk tier).

Three kinds of plan a model:
- tuned: `LMS.tune` at a budget 30% of the way from the least any plan needs to the plain peak;
- h100: the planner's plan for the H100 spec at such a budget, run here (it may recompute);
- recompute: every recipe whose recomputed inputs backward reads no earlier (chains included)
  recomputed, everything else offloaded; the harshest test of the replays.

A model passes when every step's loss and every gradient hold the same bits as the plain run's,
and no replay gave other bits than forward made. Everything runs with PyTorch's deterministic
algorithms: without them plain steps of some models differ from each other (SwinUNETR's relative
position bias gradient, an accumulating index_put, on the CPU), and the check would blame LMS
for it; each run also says whether two plain steps agreed (``plain_repeatable``). About 15
minutes on 2 cores.

    python benchmarks/zoo_bitwise.py [--models vit,lstm] [--plans tuned,recompute] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from tqdm import tqdm

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.planning import plan_auto


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(32, 64, num_layers=2, dropout=0.1)
        self.out = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0])


class _Packed(nn.Module):
    """A recurrent layer over the batch's sequences packed to lengths from all of the batch's
    time steps down to a sixth of them, and padded back (Note [A packed sequence's batch sizes
    are real])."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        bidirectional = kind == "GRU"
        self.rnn = getattr(nn, kind)(
            32, 64, num_layers=2, dropout=0.1, batch_first=True, bidirectional=bidirectional
        )
        self.out = nn.Linear(64 * (2 if bidirectional else 1), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, steps = x.shape[:2]
        lengths = torch.linspace(steps, steps // 6, rows).round().long()
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        padded, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return self.out(padded)


def _models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    import torchvision.models as tv
    from monai.networks.nets import UNETR, SegResNet, SwinUNETR, VNet
    from torchvision.models.vision_transformer import VisionTransformer

    image = (2, 3, 64, 64)
    return {
        "vit": (lambda: VisionTransformer(64, 16, 2, 4, 64, 128), image),
        "swin_t": (tv.swin_t, image),
        "convnext_tiny": (tv.convnext_tiny, image),
        "efficientnet_b0": (tv.efficientnet_b0, image),
        "mobilenet_v3_small": (tv.mobilenet_v3_small, image),
        "densenet121": (tv.densenet121, image),
        "regnet_y_400mf": (tv.regnet_y_400mf, image),
        "squeezenet1_0": (tv.squeezenet1_0, image),
        "shufflenet_v2_x1_0": (tv.shufflenet_v2_x1_0, image),
        "googlenet": (lambda: tv.googlenet(aux_logits=False, init_weights=False), image),
        "inception_v3": (
            lambda: tv.inception_v3(aux_logits=False, init_weights=False),
            (2, 3, 80, 80),
        ),
        "deeplabv3": (
            lambda: tv.segmentation.deeplabv3_mobilenet_v3_large(
                weights_backbone=None, num_classes=3
            ),
            image,
        ),
        "unetr": (
            lambda: UNETR(1, 2, 32, feature_size=8, hidden_size=96, mlp_dim=192, num_heads=4),
            (1, 1, 32, 32, 32),
        ),
        "segresnet": (
            lambda: SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=8),
            (1, 1, 32, 32, 32),
        ),
        "swin_unetr": (
            lambda: SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3),
            (1, 1, 64, 64, 64),
        ),
        "vnet": (lambda: VNet(spatial_dims=3, in_channels=1, out_channels=2), (1, 1, 32, 32, 32)),
        "r3d_18": (tv.video.r3d_18, (1, 3, 8, 32, 32)),
        "resnext50_32x4d": (tv.resnext50_32x4d, image),
        "mnasnet0_5": (tv.mnasnet0_5, image),
        "lstm": (_LSTM, (50, 4, 32)),
        "packed_lstm": (lambda: _Packed("LSTM"), (8, 60, 32)),
        "packed_gru": (lambda: _Packed("GRU"), (8, 60, 32)),
        "transformer": (
            lambda: nn.TransformerEncoder(
                nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
                3,
                enable_nested_tensor=False,
            ),
            (4, 40, 64),
        ),
    }


def _step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(*batch)
    if isinstance(out, dict):
        out = out["out"]
    loss = out.float().square().mean()
    loss.backward()
    return loss


def _run(model: nn.Module, batch: list[torch.Tensor], ctx: Any, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with ctx:
        loss = _step(model, batch)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [loss.detach().clone(), *grads]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _recompute_plan(trace: lms.Trace) -> Plan:
    found = recipes(trace)
    chosen = set(found)
    changed = True
    while changed:
        changed = False
        for ordinal in sorted(chosen):
            recipe = found[ordinal]
            if any(s in chosen and s not in recipe.chainable for s in recipe.inputs):
                chosen.discard(ordinal)
                changed = True
    entries = trace.entries()
    return Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(i for i in range(len(entries)) if i not in chosen),
        recompute=tuple(sorted(chosen)),
        num_entries=len(entries),
        entry_bytes=tuple(size for _, size, _ in entries),
        swapin_ahead=2,
    )


def _between(trace: lms.Trace, spec: lms.DeviceSpec, plan: Callable[[int], Any]) -> Any:
    """``plan(budget)`` at 30% of the way from the least any plan needs to the plain peak."""
    peak = simulate(trace, None, spec).peak_bytes
    try:
        plan(int(peak * 0.3))
    except lms.PlanInfeasibleError as error:
        return plan(int(error.min_budget_bytes + 0.3 * (peak - error.min_budget_bytes)))
    return plan(int(peak * 0.3))


def check(name: str, kind: str, spill_dir: str) -> dict[str, Any]:
    """Run ``name`` under a ``kind`` plan against plain steps; the result, JSON-ready."""
    build, shape = _models()[name]
    torch.manual_seed(0)
    model = build()
    batch = [torch.randn(*shape)]
    plain, moved = copy.deepcopy(model), copy.deepcopy(model)
    cpu = device_spec("cpu")
    if kind == "tuned":
        trace = trace_step(copy.deepcopy(model), batch, _step, device="cpu")

        def tuned(budget: int) -> lms.LMS:
            offload = lms.LMS(budget=budget, tier="disk", spill_dir=spill_dir)
            offload.tune(moved, batch, _step)
            return offload

        offload = _between(trace, cpu, tuned)
    else:
        trace = trace_step(copy.deepcopy(model), batch, _step, device="cpu", min_offload_bytes=0)
        if kind == "h100":
            h100 = device_spec("h100")
            plan = _between(trace, h100, lambda b: plan_auto(trace, h100.with_memory(b), b))
        else:
            plan = _recompute_plan(trace)
        offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    assert offload.plan is not None
    bitwise = True
    repeatable = _same(
        _run(copy.deepcopy(plain), batch, contextlib.nullcontext(), 0),
        _run(copy.deepcopy(plain), batch, contextlib.nullcontext(), 0),
    )
    for seed in range(3):
        ref = _run(plain, batch, contextlib.nullcontext(), seed)
        got = _run(moved, batch, offload, seed)
        bitwise = bitwise and _same(ref, got)
    stats = offload.stats
    offload.close()
    return {
        "model": name,
        "plan": kind,
        "bitwise": bitwise and stats.replays_differed == 0,
        "offloaded_per_step": stats.offloaded_tensors // 3,
        "recomputed_per_step": stats.recomputed_tensors // 3,
        "replays_differed": stats.replays_differed,
        "diverged_steps": stats.diverged_steps,
        "saved_entries": offload.plan.num_entries,
        "plain_repeatable": repeatable,
    }


def _same(ref: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(ref) == len(got) and all(
        torch.equal(_bits(a), _bits(b)) for a, b in zip(ref, got, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(_models()))
    parser.add_argument("--plans", default="tuned,h100,recompute")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.use_deterministic_algorithms(True)
    cases = [(m, k) for m in args.models.split(",") for k in args.plans.split(",")]
    results = []
    started = time.perf_counter()
    for name, kind in tqdm(cases, desc="zoo", unit="run"):
        with tempfile.TemporaryDirectory() as spill_dir:
            result = check(name, kind, spill_dir)
        results.append(result)
        tqdm.write(
            f"{name:20s} {kind:9s} {'bitwise' if result['bitwise'] else 'DIFFERS':8s} "
            f"offloaded {result['offloaded_per_step']:3d}, recomputed "
            f"{result['recomputed_per_step']:3d} of {result['saved_entries']} a step"
            + (f", left the plan in {result['diverged_steps']}" if result["diverged_steps"] else "")
        )
    passed = sum(r["bitwise"] for r in results)
    print(f"{passed} of {len(results)} runs bitwise in {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "runs": results}, out, indent=1)
    if passed != len(results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
