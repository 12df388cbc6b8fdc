"""Submodules run in slabs (Note [Slabs]): the same step within float rounding, exact in float64,
the module whole again after, and clear refusals."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lms.core.slabs import SplitError, slab_bounds, split_modules


class Block(nn.Module):
    """What a U-Net's decoder does at full resolution: concatenate two inputs along the
    channels, pad across the other dims, then convolution, norm, activation twice."""

    def __init__(self, norm, dims=3, kernel=3, dilation=1, stride=1):
        super().__init__()
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        pad = dilation * (kernel - 1) // 2
        self.a = conv(8, 6, kernel, padding=pad, dilation=dilation, stride=stride)
        self.na = norm(6)
        self.b = conv(6, 4, kernel, padding="same", bias=False)
        self.nb = norm(4)

    def forward(self, x, skip):
        x = torch.cat([skip, F.pad(x, [0, 0] * (x.dim() - 3) + [0, 0])], dim=1)
        x = F.leaky_relu(self.na(self.a(x)), 0.1, True)
        return F.relu(self.nb(self.b(x)) + x[:, :4])


class Net(nn.Module):
    def __init__(self, norm, dims=3, **conv):
        super().__init__()
        conv_type = nn.Conv3d if dims == 3 else nn.Conv2d
        self.stem = conv_type(1, 4, 3, padding=1)
        self.block = Block(norm, dims, **conv)
        self.head = conv_type(4, 2, 1)

    def forward(self, x):
        s = self.stem(x)
        return self.head(self.block(s, s))


NORMS = {
    "instance": lambda c: nn.InstanceNorm3d(c, affine=True),
    "instance_tracked": lambda c: nn.InstanceNorm3d(c, affine=True, track_running_stats=True),
    "batch": nn.BatchNorm3d,
    "group": lambda c: nn.GroupNorm(2, c),
}


def _step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("slabs", [2, 5])
def test_a_step_in_slabs_is_exact_in_float64(norm, slabs):
    """In float64 the slabs compute the same function and gradients as the whole module (to
    1e-10), the running statistics included; the module is whole again after."""
    torch.manual_seed(0)
    model = Net(NORMS[norm]).double()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 1, 13, 6, 5, dtype=torch.float64)
    loss, grads = _step(model, x)
    with split_modules(twin, {"block": slabs}):
        split_loss, split_grads = _step(twin, x)
        assert "forward" in twin.block.__dict__
    assert "forward" not in twin.block.__dict__
    assert torch.allclose(loss, split_loss, rtol=1e-12, atol=0)
    for grad, split in zip(grads, split_grads, strict=True):
        assert torch.allclose(grad, split, rtol=1e-9, atol=1e-12)
    for buffer, split in zip(model.buffers(), twin.buffers(), strict=True):
        assert torch.allclose(buffer.double(), split.double(), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "conv", [{"kernel": 5}, {"kernel": 3, "dilation": 2}, {"kernel": 3, "stride": 2}]
)
def test_wider_kernels_read_wider_halos_in_two_dims(conv):
    torch.manual_seed(0)
    norm = lambda c: nn.InstanceNorm2d(c, affine=True)  # noqa: E731
    model = Net(norm, dims=2, **conv).double()
    twin = copy.deepcopy(model)
    x = torch.randn(1, 1, 17, 9, dtype=torch.float64)
    _, grads = _step(model, x)
    with split_modules(twin, {"block": 4}):
        _, split_grads = _step(twin, x)
    for grad, split in zip(grads, split_grads, strict=True):
        assert torch.allclose(grad, split, rtol=1e-9, atol=1e-12)


def test_in_float32_the_slabs_are_as_near_float64_as_the_whole_module():
    """Not bitwise: the weight gradients are summed slab by slab and the statistics combined.
    Against the same step in float64, the step in slabs is no further off than the whole
    module's own float32 step (twice its distance at most)."""
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 8, 4))
    reference, twin = copy.deepcopy(model).double(), copy.deepcopy(model)
    x = torch.randn(1, 1, 32, 32, 32)
    _, exact = _step(reference, x.double())
    _, whole = _step(model, x)
    with split_modules(twin, {"upcat_1": 4, "conv_0": 3}):
        _, split = _step(twin, x)

    def distance(grads):
        return max(
            ((g.double() - e).norm() / e.norm()).item()
            for g, e in zip(grads, exact, strict=True)
            if e.norm() > 1e-6 * max(t.norm() for t in exact)  # not a bias before a norm
        )

    assert distance(split) <= 2 * distance(whole) + 1e-6, (distance(split), distance(whole))
    assert any(not torch.equal(a, b) for a, b in zip(split, whole, strict=True))


def test_what_the_slabs_save_is_slab_sized():
    """The largest tensor autograd saves inside the module is a slab and its halo, not the
    whole input the block concatenates."""
    torch.manual_seed(0)
    model = Net(NORMS["instance"])
    x = torch.randn(1, 1, 40, 8, 8)
    sizes = []

    def pack(tensor):
        sizes.append(tensor.untyped_storage().nbytes())
        return tensor

    whole_input = 1 * 8 * 40 * 8 * 8 * 4  # the concatenation of the two 4-channel inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.block(model.stem(x), model.stem(x)).sum()
    assert max(sizes) >= whole_input
    sizes.clear()
    with (
        split_modules(model, {"block": 8}),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        s = model.stem(x)
        model.block(s, s).sum()
    inside = sorted(sizes)[:-2]  # the stem's two saves are whole
    assert max(inside) <= whole_input * (5 + 4) // 40, max(inside)


def test_a_dropout_that_draws_runs_whole_and_draws_as_the_whole_module():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(F.dropout(self.conv(x), 0.5, True))

    torch.manual_seed(0)
    model = nn.Sequential(Drop()).double()
    x = torch.randn(1, 2, 12, 4, 4, dtype=torch.float64)
    torch.manual_seed(1)
    whole = model(x)
    with split_modules(model, {"0": 3}):
        torch.manual_seed(1)
        split = model(x)
    assert torch.allclose(whole, split, rtol=1e-12, atol=1e-14)


def test_bad_names_and_counts_are_refused_before_any_module_changes():
    model = Net(NORMS["instance"])
    names = {"block": 4, "nope": 4}
    with pytest.raises(SplitError, match="no submodule 'nope'"), split_modules(model, names):
        pass
    assert "forward" not in model.block.__dict__
    for count in (1, 2.5, True):
        with pytest.raises(SplitError, match="at least 2"), split_modules(model, {"block": count}):
            pass


def test_a_forward_that_reads_a_tensor_it_was_not_given_is_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.ones(1)  # neither a parameter nor a buffer

        def forward(self, x):
            return x * self.table

    model = nn.Sequential(Odd())
    with split_modules(model, {"0": 2}), pytest.raises(SplitError, match="neither an input"):
        model(torch.randn(1, 1, 4, 4))


def test_slab_bounds_cover_the_rows_once():
    assert slab_bounds(10, 4) == [0, 2, 5, 7, 10]
    assert slab_bounds(3, 8) == [0, 1, 2, 3]


class NormFirst(nn.Module):
    """A residual block that normalizes its input first (MONAI's SegResNet does) and makes a
    tensor on its input's device, as stochastic depth's noise is made."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)
        self.conv = nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x):
        scale = torch.full((1, 4, 1, 1, 1), 0.5, dtype=x.dtype, device=x.device)
        return self.conv(F.relu(self.norm(x))) * scale + x


def test_a_norm_of_the_whole_input_runs_a_slab_at_a_time_and_tensors_go_to_its_device():
    """The norm that reads the module's own input takes its statistics slab by slab (no
    whole-tensor norm kernel runs), a tensor made on the input's device is made on it, not on
    the meta device the forward was recorded on, and the step is exact in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), NormFirst()).double()
    twin = copy.deepcopy(model)
    x = torch.randn(1, 1, 12, 5, 5, dtype=torch.float64)
    loss, grads = _step(model, x)
    called = []
    with (
        split_modules(twin, {"1": 3}),
        torch.overrides.TorchFunctionMode.__new__(_Names).with_log(called),
    ):
        split_loss, split_grads = _step(twin, x)
    assert "group_norm" not in called and "var_mean" in called, called
    assert torch.allclose(loss, split_loss, rtol=1e-12, atol=0)
    for grad, split in zip(grads, split_grads, strict=True):
        assert torch.allclose(grad, split, rtol=1e-9, atol=1e-12)


class _Names(torch.overrides.TorchFunctionMode):
    def with_log(self, log):
        torch.overrides.TorchFunctionMode.__init__(self)
        self.log = log
        return self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
        if not any(t.is_meta for t in tensors):  # the recording runs on meta tensors
            self.log.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_module_in_slabs_joins_its_output_with_one_slab_beside_it():
    """Note [A whole value is written a slab at a time]: no op takes every piece at once (a
    cat would, beside the whole it makes); each is written into the output alone."""
    from lms.analysis import trace_step

    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.Sequential(nn.Conv3d(4, 4, 1)))
    x = torch.randn(1, 1, 32, 16, 16)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    trace = trace_step(model, [x], step, device="cpu", slabs={"1": 8})
    inside = [op for op in trace.ops if op.phase == "forward" and op.module.endswith(".1")]
    assert max(len(op.inputs) for op in inside) < 8, [(op.name, op.inputs) for op in inside]
    assert sum(op.name == "aten.index_copy_.default" for op in inside) == 8


def test_a_container_that_is_never_called_is_refused():
    model = nn.Sequential(nn.Conv2d(1, 1, 1))
    model.blocks = nn.ModuleList([nn.Conv2d(1, 1, 1)])
    refused = pytest.raises(SplitError, match="ModuleList, whose forward is never called")
    with refused, split_modules(model, {"blocks": 2}):
        pass
