"""The fake-tensor trace: peaks against torch's MemTracker, events against the runtime."""

import contextlib
import copy
import dataclasses
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import lms
from lms.analysis import simulate, trace_step
from lms.core.devices import device_spec
from lms.planning.candidates import Candidates
from tests.conftest import assert_bitwise, run_step


def memtracker_peak(build, shape):
    with FakeTensorMode():
        model = build()
        x = torch.randn(*shape)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(x).float().mean().backward()
        return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def resnet18():
    from torchvision.models import resnet18

    return resnet18(weights=None)


def unet3d():
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2)


@pytest.mark.parametrize(
    ("build", "shape"), [(resnet18, (2, 3, 160, 160)), (unet3d, (1, 1, 32, 32, 32))]
)
def test_no_lms_peak_within_5pct_of_memtracker(build, shape):
    trace = trace_step(build, lambda: [torch.randn(*shape)], device="cpu")
    ours = simulate(trace, None, device_spec("v100-32gb")).peak_tensor_bytes
    reference = memtracker_peak(build, shape)
    assert abs(ours / reference - 1) < 0.05, (ours, reference)


def test_trace_uses_no_real_memory():
    from lms.harness.memory import PeakMemory

    with PeakMemory() as memory:
        trace = trace_step(resnet18, lambda: [torch.randn(24, 3, 1024, 1024)], device="cpu")
    peak = simulate(trace, None, device_spec("v100-32gb")).peak_tensor_bytes
    assert peak > 8 * 2**30
    assert memory.growth_bytes < 1 * 2**30


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.b = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.a(x)))
        y = torch.sigmoid(self.b(y)) * y
        return self.fc(y.mean((2, 3)))


def test_saved_events_match_the_runtime(tmp_path):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 3, 64, 64)
    trace = trace_step(model, [x], device="cpu", min_offload_bytes=0)
    # the real model's parameters are back in place after tracing
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    offload = lms.LMS(budget="64MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    for _ in range(2):
        with offload:
            model(x).float().mean().backward()
    record = offload._record
    entries = trace.entries()
    assert [size for _, size, _ in entries] == list(record.nbytes)
    saves = [e.level for e in trace.events if e.kind == "save" and e.offloadable]
    first_saves = []
    seen = set()
    for event in trace.events:
        if event.kind == "save" and event.offloadable and event.storage not in seen:
            seen.add(event.storage)
            first_saves.append(event.level)
    assert first_saves == list(record.save_level)
    assert len(saves) >= len(first_saves)
    uses = {}
    for event in trace.events:
        if event.kind == "use" and event.offloadable:
            uses.setdefault(event.storage, event.level)
    assert [uses.get(s) for s, _, _ in entries] == list(record.first_use_level)


class TwoLayerLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(32, 64, num_layers=2, dropout=0.1)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


def test_fused_lstm_workspace_keeps_its_place_among_saved_tensors(tmp_path, caplog):
    # Note [Workspaces fake tensors cannot size]: oneDNN's LSTM layer saves a workspace that
    # its fake kernel gives no bytes; without an estimate a plan's ordinals shift after it.
    torch.manual_seed(0)
    model = TwoLayerLSTM()
    x = torch.randn(50, 4, 32)

    def step(m, batch):  # as run_step's
        m(*batch).float().square().mean().backward()

    trace = trace_step(model, [x], step, device="cpu", min_offload_bytes=0)
    if "aten.mkldnn_rnn_layer.default" not in {op.name for op in trace.ops}:
        pytest.skip("this build runs the LSTM without oneDNN")
    recorder = lms.LMS(budget="64MiB", min_offload_bytes=0, spill_dir=str(tmp_path))
    for _ in range(2):  # the second step takes the first one's record
        run_step(model, [x], recorder)
    real = list(recorder._record.nbytes)
    recorder.close()
    traced = [size for _, size, _ in trace.entries()]
    assert len(traced) == len(real)
    estimated = [(s, r) for s, r in zip(traced, real, strict=True) if s != r]
    assert len(estimated) == 2  # one workspace a layer, each within 10%
    assert all(abs(size - actual) <= 0.1 * actual for size, actual in estimated)

    # Only autograd holds the workspaces (Note [Tensors the step's code holds]): the plan that
    # moves every saved storage moves them, and names each by the runtime's ordinal.
    ref = run_step(model, [x])
    plan = Candidates(trace, device_spec("cpu"), 1).plan(range(len(traced)), source="minimum")
    workspaces = [i for i, (s, r) in enumerate(zip(traced, real, strict=True)) if s != r]
    assert set(workspaces) <= set(plan.offload) and max(plan.offload) > min(workspaces)
    moved = lms.LMS(plan=plan, min_offload_bytes=0, spill_dir=str(tmp_path), tier="disk")
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(ref, run_step(model, [x], moved))
    assert "saves tensors other than" not in caplog.text
    assert moved.stats.offloaded_tensors == 2 * len(plan.offload)
    moved.close()


class CudnnLSTM(torch.nn.Module):
    """One LSTM layer run by cuDNN's RNN call, which a GPU's ``nn.LSTM`` makes: its weights in
    one buffer (as ``flatten_parameters`` lays them) or, with ``flat=False``, apart."""

    def __init__(self, flat=True):
        super().__init__()
        lstm = torch.nn.LSTM(32, 64)
        weights = [getattr(lstm, name) for name in lstm._flat_weights_names]
        buffer = torch.cat([w.detach().flatten() for w in weights])
        ends = list(itertools.accumulate(w.numel() for w in weights))
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(buffer[a:b].view_as(w) if flat else w.detach().clone())
            for w, a, b in zip(weights, [0, *ends[:-1]], ends, strict=True)
        )

    def forward(self, x):
        h = x.new_zeros(1, x.shape[1], 64)
        weights = list(self.weights)
        out = torch.ops.aten._cudnn_rnn(
            x, weights, 4, None, h, h, 2, 64, 0, 1, False, 0.0, True, False, [], None
        )
        return out[0]


@pytest.mark.parametrize("flat", [True, False])
def test_cudnn_rnn_is_traced_with_the_weight_buffer_it_finds(flat):
    # Note [Fake weights share their buffer]: the fake call finds no buffer by address, and
    # backward then failed for want of one ("Expected a proper Tensor but got None for argument
    # #3 'weight_buf'"); it has no fake kernel either.
    model = CudnnLSTM(flat)
    weight_bytes = sum(w.nbytes for w in model.weights)
    trace = trace_step(
        model,
        [torch.randn(50, 4, 32)],
        lambda m, batch: m(*batch).square().mean().backward(),
        device="cpu",
        min_offload_bytes=0,
    )
    assert trace.param_bytes == trace.gradient_bytes == weight_bytes
    saved = [size for _, size, _ in trace.entries()]
    # Laid out as one buffer, cuDNN saves that buffer: the parameters, which stay. Apart, it
    # copies them into a buffer of its own and saves that.
    assert (weight_bytes in saved) is not flat
    assert all(isinstance(w, torch.nn.Parameter) for w in model.weights)  # put back


def test_tied_and_sharing_parameters_are_traced_as_the_storage_they_share():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64, bias=False)
            self.b = torch.nn.Linear(64, 64, bias=False)
            self.b.weight = self.a.weight  # one parameter, two modules
            halves = torch.zeros(200)
            self.p = torch.nn.Parameter(halves[:100])  # two parameters, one storage
            self.q = torch.nn.Parameter(halves[100:])

        def forward(self, x):
            return self.b(self.a(x)).sum() + (self.p * self.q).sum()

    model = Tied()
    trace = trace_step(model, [torch.randn(8, 64)], lambda m, b: m(*b).backward(), device="cpu")
    assert trace.param_bytes == 64 * 64 * 4 + 200 * 4
    assert trace.gradient_bytes == 64 * 64 * 4 + 200 * 4  # one gradient for the tied weight
    assert model.b.weight is model.a.weight


def test_trace_records_ops_flops_and_modules():
    trace = trace_step(Net, lambda: [torch.randn(2, 3, 32, 32)], device="cpu")
    names = [op.name for op in trace.ops]
    assert "aten.convolution.default" in names
    assert "aten.convolution_backward.default" in names
    conv = next(op for op in trace.ops if op.name == "aten.convolution.default")
    assert conv.flops == 2 * 2 * 16 * 3 * 9 * 32 * 32
    assert conv.module == "Net.a"
    assert conv.phase == "forward"
    assert trace.backward_start_op < len(trace.ops)
    assert trace.param_bytes == sum(p.numel() * 4 for p in Net().parameters())
    assert trace.num_levels > 1 and trace.num_edges >= len(trace.ops) - 1
    assert (
        trace.fingerprint()
        == trace_step(Net, lambda: [torch.randn(2, 3, 32, 32)], device="cpu").fingerprint()
    )


def test_optimizer_state_is_counted():
    trace = trace_step(
        Net,
        lambda: [torch.randn(2, 3, 32, 32)],
        device="cpu",
        optimizer=lambda params: torch.optim.Adam(params),
    )
    assert trace.state_bytes >= 2 * trace.param_bytes
    assert trace.gradient_bytes == trace.param_bytes


def test_backward_ops_are_named_by_the_module_that_made_their_node():
    # The embedding's input needs no gradient, so module hooks never see its backward; the
    # trace names it by the autograd node that runs it.
    from lms.harness.zoo import TinyLM, _lm_step

    tokens = torch.randint(0, 100, (2, 16))
    trace = trace_step(
        lambda: TinyLM(vocab=100, dim=32, layers=2, heads=2), [tokens, tokens], _lm_step
    )
    backward = [op for op in trace.ops if op.phase == "backward"]
    by_name = {op.name: op.module for op in backward}
    assert by_name["aten.embedding_dense_backward.default"] == "TinyLM.embed"
    norms = [op.module for op in backward if op.name == "aten.native_layer_norm_backward.default"]
    assert sorted(norms) == sorted(
        ["TinyLM.norm"] + [f"TinyLM.blocks.{i}.norm{j}" for i in range(2) for j in (1, 2)]
    )


def test_a_modules_own_ops_before_an_inner_module_are_named_by_it_in_backward():
    # The softmax runs in the attention's own forward before its output projection: backward
    # reaches it through the projection's nodes, and it is still the attention's.
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = torch.nn.Linear(16, 32)
            self.out = torch.nn.Linear(16, 16)

        def forward(self, x):
            q, k = self.qk(x).chunk(2, dim=-1)
            weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
            return self.out(weights @ x)

    trace = trace_step(Attention, lambda: [torch.randn(2, 8, 16)])
    backward = {op.name: op.module for op in trace.ops if op.phase == "backward"}
    assert backward["aten._softmax_backward_data.default"] == "Attention"
    assert backward["aten.bmm.default"] == "Attention"


def test_a_sparse_gradient_is_traced_as_its_indices_and_values(tmp_path):
    """Note [A sparse tensor is its parts]: the trace raised on the sparse gradient of an
    embedding made with sparse=True (a sparse tensor has no storage)."""

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Embedding(1000, 64, sparse=True),
            *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)],
        )

    tokens = torch.randint(0, 1000, (4, 256))
    trace = trace_step(build, [tokens], device="cpu")
    dense = sum(4 * 64 * 64 + 4 * 64 for _ in range(3))
    sparse = tokens.numel() * (8 + 64 * 4)  # one index and one row a token
    assert trace.gradient_bytes == dense + sparse
    model, plain = build(), build()
    offload = lms.LMS(budget="70%", tier="disk", spill_dir=str(tmp_path))
    plan = offload.tune(model, [tokens], lambda m, b: m(*b).float().square().mean().backward())
    assert plan.offload or plan.recompute

    def dense(run):
        return run[0], [g.to_dense() if g.is_sparse else g for g in run[1]]

    for _ in range(2):
        assert_bitwise(dense(run_step(plain, [tokens])), dense(run_step(model, [tokens], offload)))
    assert offload.stats.diverged_steps == 0
    offload.close()


def test_a_step_whose_shapes_depend_on_the_data_cannot_be_traced():
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.linear(x)
            return y[y > 0]

    with pytest.raises(
        lms.core.errors.StepFailedError, match="output depends on the data"
    ) as raised:
        trace_step(Masked, [torch.randn(4, 8)])  # built under fake tensors: no values to read
    assert "DynamicOutputShapeException: aten.nonzero.default" in str(raised.value)


def test_a_builder_that_reads_tensor_values_is_built_for_real(caplog):
    # RegNet computes its widths with tensors; fake tensors have no values to give.
    def build():
        width = int(torch.tensor([3.0, 5.0]).sum().item())  # 8
        return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU())

    with caplog.at_level("INFO", logger="lms"):
        trace = trace_step(build, [torch.randn(2, 4)], device="cpu")
    assert "building it for real" in caplog.text
    assert trace.param_bytes == (4 * 8 + 8) * 4
    caplog.clear()
    with caplog.at_level("INFO", logger="lms"):  # traced again (in slabs, at another size)
        again = trace_step(build, [torch.randn(3, 4)], device="cpu")
    assert "building it for real" not in caplog.text  # said once
    assert again.param_bytes == trace.param_bytes
    with pytest.raises(TypeError, match="not a module"):
        trace_step(lambda: 3, [torch.randn(2, 4)], device="cpu")


def test_a_builder_that_converts_its_module_is_built_for_real(caplog):
    # PyTorch cannot convert fake parameters in place: `.to(memory_format=...)` swaps them.
    def build():
        return torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)

    with caplog.at_level("INFO", logger="lms"):
        trace = trace_step(build, [torch.randn(1, 3, 16, 16)], device="cpu")
    assert "converts its parameters" in caplog.text
    assert trace.param_bytes == (8 * 3 * 9 + 8) * 4


def test_a_builder_that_deep_copies_a_batch_norm_is_traced_under_fake_tensors(caplog):
    # MONAI's SegResNetDS2 copies its decoder with copy.deepcopy; a fake batch norm's buffers
    # went through their storage, and the failed copy left the heap corrupted (the process
    # aborted at exit). Note [A fake tensor deep-copied]
    def build():
        norm = torch.nn.BatchNorm1d(4)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), norm, copy.deepcopy(norm))

    with caplog.at_level("INFO", logger="lms"):
        trace = trace_step(build, [torch.randn(2, 4)], device="cpu")
    assert "building it for real" not in caplog.text  # built fake: costs no memory
    assert trace.param_bytes == (4 * 4 + 4 + 2 * (4 + 4)) * 4
    assert "__deepcopy__" not in FakeTensor.__dict__  # only while the builder runs


def test_a_builder_that_fails_under_fake_tensors_is_built_for_real(caplog):
    def build():
        width = int(torch.tensor([8]).numpy()[0])  # fake tensors have no numpy()
        return torch.nn.Linear(4, width)

    with caplog.at_level("INFO", logger="lms"):
        trace = trace_step(build, [torch.randn(2, 4)], device="cpu")
    assert "fails under fake tensors (RuntimeError" in caplog.text
    assert "building it for real" in caplog.text
    assert trace.param_bytes == (4 * 8 + 8) * 4

    def broken():  # fails for real too: the builder's own error, not a fake tensor's
        raise KeyError("no such layer")

    with pytest.raises(KeyError, match="no such layer"):
        trace_step(broken, [torch.randn(2, 4)], device="cpu")


def _conv_trace(layout):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 3))
    x = torch.randn(1, 3, 64, 64)
    model, x = model.to(memory_format=layout), x.contiguous(memory_format=layout)
    return trace_step(model, [x], device="cpu")


def test_a_contiguous_convolution_takes_cpu_scratch_and_only_the_cpu_counts_it():
    # Note [Convolution scratch on the CPU]. PyTorch runs the first convolution (one sample of 3
    # channels) with its native kernel, the second (16 channels of 64x64) with oneDNN.
    trace = _conv_trace(torch.contiguous_format)
    scratch = {op.index: op.cpu_scratch_bytes for op in trace.ops if "convolution" in op.name}
    first, second, second_back, first_back = scratch.values()
    assert first == first_back == 3 * 9 * 64 * 64 * 4  # a column of 3x3 taps a position
    weights = 16 * 16 * 9 * 4  # copied into oneDNN's layout; backward also their gradient
    assert second == weights + 16 * 64 * 64 * 4  # and its input, larger than its output
    # and the gradient out, and the input (or its gradient)
    assert second_back == 2 * weights + 16 * 62 * 62 * 4 + 16 * 64 * 64 * 4
    assert all(op.cpu_scratch_bytes == 0 for op in trace.ops if op.index not in scratch)

    cpu = device_spec("cpu")
    peaks = [
        simulate(trace, None, spec).peak_tensor_bytes
        for spec in (cpu, dataclasses.replace(cpu, cpu_scratch=False), device_spec("v100"))
    ]
    assert peaks[0] > peaks[1] == peaks[2]
    last = _conv_trace(torch.channels_last)  # oneDNN takes it as it is at stride 1
    moved = {op.index: op.cpu_scratch_bytes for op in last.ops if "convolution" in op.name}
    # but for the gradient of the sum, which comes contiguous: backward copies it into the layout
    # (measured: 288 KiB over its outputs, for these 258 KiB)
    relaid = 16 * 62 * 62 * 4
    # the native kernel copies its input contiguous, and in backward its output gradient too
    image, features = 3 * 64 * 64 * 4, 16 * 64 * 64 * 4
    native = [first + image, first + features + image]
    assert list(moved.values()) == [native[0], weights, 2 * weights + relaid, native[1]], moved
    assert last.fingerprint() != trace.fingerprint()


def test_transposed_and_half_precision_convolutions_take_their_cpu_scratch():
    # Note [Convolution scratch on the CPU]. PyTorch names oneDNN's transposed kernel "???" in
    # Python; it copies the output in and out as the untransposed one copies its input.
    up = torch.nn.ConvTranspose2d(16, 16, 2, stride=2)
    trace = trace_step(up, [torch.randn(1, 16, 64, 64)], device="cpu")
    (forward,) = [op for op in trace.ops if op.name == "aten.convolution.default"]
    weights = 16 * 16 * 4 * 4
    assert forward.cpu_scratch_bytes == weights + 2 * 16 * 128 * 128 * 4

    # In bfloat16 a weight gradient also takes its input and output gradient in single
    # precision, channels counted up to a block; a first layer of 3 channels does not.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 8, 3))

    def half(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(*batch).sum().backward()

    def backward_scratch(step):
        trace = trace_step(model, [torch.randn(1, 3, 64, 64)], step, device="cpu")
        ops = [op for op in trace.ops if op.name == "aten.convolution_backward.default"]
        return {op.module: op.cpu_scratch_bytes for op in ops}

    scratch = [backward_scratch(half), backward_scratch(None)]
    tensors = 16 * 62 * 62 + 16 * 64 * 64  # the output gradient and the input, 8 channels as 16
    relaid = 8 * 62 * 62 * 2  # the sum's gradient comes expanded in bfloat16: copied in first
    assert scratch[0]["Sequential.1"] == 2 * 8 * 16 * 9 * 2 + relaid + tensors * 2 + 2 * tensors * 2
    assert scratch[1]["Sequential.1"] == 2 * 8 * 16 * 9 * 4 + tensors * 4
    assert scratch[0]["Sequential.0"] < scratch[1]["Sequential.0"]


def test_a_contiguous_convolution_makes_its_output_blocked_beside_its_input():
    """Note [Convolution scratch on the CPU]: oneDNN makes a contiguous convolution's output in
    blocks of 16 channels beside its blocked input, then copies it out; an input of fewer
    channels than a block it reads as it is. Measured: 16.96 MiB for 32->8 channels at 48^3,
    16.02 for 4->16 channels, stride 2, at 1024x1024 (64 were estimated before)."""

    def forward_scratch(conv, x):
        trace = trace_step(conv, [x], device="cpu")
        (op,) = [op for op in trace.ops if op.name == "aten.convolution.default"]
        return op.cpu_scratch_bytes

    weights = 8 * 32 * 27 * 4
    blocked_in, blocked_out, out = (c * 48**3 * 4 for c in (32, 16, 8))
    narrowing = forward_scratch(
        torch.nn.Conv3d(32, 8, 3, padding=1), torch.randn(1, 32, 48, 48, 48)
    )
    assert narrowing == weights + blocked_in + blocked_out - out
    stem = forward_scratch(torch.nn.Conv2d(4, 16, 3, 2, 1), torch.randn(1, 4, 1024, 1024))
    assert stem == 16 * 4 * 9 * 4 + 16 * 512 * 512 * 4  # the output alone


def test_a_pointwise_convolution_blocks_an_input_of_few_channels_or_reads_it_as_columns():
    """Note [Convolution scratch on the CPU]: oneDNN's pointwise kernel makes even an input of
    fewer channels than a block blocked, beside its blocked output; PyTorch's native one, at
    stride 1 without padding, reads its input as its columns. Measured for a segmentation head,
    8->2 channels 1x1x1 at 128^3: 239.9 MiB over its output (128.0 were estimated, which put
    SegResNet's floor past a budget its slabs were searched for) and 29.9 at 64^3, and 0.0 for
    4->4 channels at 64^3 on the native kernel (4.0 estimated)."""

    def forward_scratch(conv, x):
        trace = trace_step(conv, [x], device="cpu")
        (op,) = [op for op in trace.ops if op.name == "aten.convolution.default"]
        return op.cpu_scratch_bytes

    head = torch.nn.Conv3d(8, 2, 1)
    blocked, out = 16 * 64**3 * 4, 2 * 64**3 * 4  # input and output, 16 channels each
    assert forward_scratch(head, torch.randn(1, 8, 64, 64, 64)) == 2 * 8 * 4 + 2 * blocked - out
    native = torch.randn(1, 4, 48, 48, 48)  # one sample of few channels
    assert forward_scratch(torch.nn.Conv3d(4, 4, 1), native) == 0
    strided = torch.nn.Conv3d(4, 4, 1, stride=2)  # its columns are the input's every other row
    assert forward_scratch(strided, native) == 4 * 24**3 * 4


def test_a_half_precision_weight_gradient_of_few_channels_is_widened_past_a_first_layer():
    """Note [Convolution scratch on the CPU]: in bfloat16 a weight gradient takes its input and
    output gradient in single precision, blocked, also below a block of input channels, but for
    a first layer (no input gradient). Measured for a segmentation head, 8->2 channels 1x1x1 at
    64^3: 44.0 MiB over its tensors (16.0 were estimated)."""

    def head_scratch(model):
        def step(m, batch):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m(*batch).float().square().mean().backward()

        trace = trace_step(model, [torch.randn(1, 8, 32, 32, 32)], step, device="cpu")
        ops = [op for op in trace.ops if op.name == "aten.convolution_backward.default"]
        return ops[0].cpu_scratch_bytes  # backward reaches the head first

    head = torch.nn.Conv3d(8, 2, 1)
    alone = head_scratch(head)  # its input needs no gradient
    behind = head_scratch(torch.nn.Sequential(torch.nn.Conv3d(8, 8, 3, padding=1), head))
    blocked = 16 * 32**3  # elements of the input, and of the output gradient, 16 channels each
    assert behind - alone == 4 * blocked + 4 * blocked  # both in single precision


def test_a_native_transposed_convolution_copies_its_channels_last_input():
    """Note [Convolution scratch on the CPU]: a 3D upsampling of few channels runs PyTorch's
    native kernel, which unfolds into columns and takes its input contiguous, forward and
    backward. Measured for 8 channels from 32^3 to 64^3: 9.0 MiB over its tensors each way."""
    fmt = torch.channels_last_3d
    up = torch.nn.ConvTranspose3d(8, 8, 2, stride=2).to(memory_format=fmt)
    x = torch.randn(1, 8, 32, 32, 32).contiguous(memory_format=fmt)
    trace = trace_step(up, [x], device="cpu")
    scratch = {op.name: op.cpu_scratch_bytes for op in trace.ops if "convolution" in op.name}
    columns = 8 * 8 * 32**3 * 4  # channels out x taps x input positions
    given = 8 * 32**3 * 4
    assert scratch["aten.convolution.default"] == columns + given
    assert scratch["aten.convolution_backward.default"] == columns + given


class _Holds(torch.nn.Module):
    """Three layers; ``hold`` keeps the first one's output in a local until forward returns."""

    def __init__(self, hold):
        super().__init__()
        self.one, self.two, self.three = (torch.nn.Linear(64, 64) for _ in range(3))
        self.hold = hold

    def forward(self, x):
        if self.hold:
            kept = self.one(x)
            y = self.two(kept.relu())
        else:
            y = self.two(self.one(x).relu())
        return self.three(y.relu())


@pytest.mark.parametrize("hold", [False, True])
def test_a_tensor_the_code_holds_is_in_use_until_it_dies(hold):
    # Note [Tensors the step's code holds]
    trace = trace_step(_Holds(hold), [torch.randn(32, 64)], device="cpu")
    ops = [op for op in trace.ops if op.phase == "forward"]
    made = next(op for op in ops if op.module.endswith("one") and op.name.startswith("aten.addmm"))
    read = max(op.index for op in ops if made.outputs[0] in op.inputs)
    last = max(op.index for op in ops if op.module.endswith("three"))
    assert read < last
    held_to = trace.storages[made.outputs[0]].last_forward_op
    assert held_to >= last if hold else held_to == read


def test_a_saved_tensor_that_needs_no_gradient_is_not_held_by_the_save():
    # Max pooling's indices: autograd saves them and the model's code never sees them, so the
    # runtime's copy frees them; the trace's save must not keep them in use into backward.
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 8, 3)
    )
    trace = trace_step(model, [torch.randn(1, 3, 32, 32)], device="cpu", min_offload_bytes=0)
    pool = next(op for op in trace.ops if op.name.startswith("aten.max_pool2d_with_indices"))
    indices = pool.outputs[1]
    assert indices in {storage for storage, _, _ in trace.entries()}  # saved, and may move
    assert indices not in trace.held_by_code
    assert trace.storages[indices].last_forward_op == pool.index


def test_a_mixture_of_experts_in_single_precision_is_traced_as_it_runs_on_the_cpu(spill_dir):
    """Note [Grouped products the CPU takes in single precision]: a float32 Qwen2-MoE traces on
    the CPU, its grouped products as large as the real ones, and follows its plan bitwise."""
    transformers = pytest.importorskip("transformers")
    from torch.utils._python_dispatch import TorchDispatchMode

    config = transformers.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(m, batch):
        loss = m(input_ids=batch[0], labels=batch[0]).loss
        loss.backward()
        return loss

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nbytes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._grouped_mm.default:
                self.nbytes.append(out.numel() * out.element_size())
            return out

    with Sizes() as real:
        step(model, [ids])
    if not real.nbytes:
        pytest.skip("this transformers does not call torch._grouped_mm on the CPU")
    model.zero_grad(set_to_none=True)
    trace = trace_step(model, [ids], step, device="cpu", min_offload_bytes=0)
    grouped = [op for op in trace.ops if op.name == "aten._grouped_mm.default"]
    assert len(grouped) == len(real.nbytes)
    assert {op.phase for op in grouped} == {"forward", "backward"}
    for op, nbytes in zip(grouped, real.nbytes, strict=True):
        assert op.written_bytes >= nbytes  # the fake kernel pads rows as the CUDA one does
    n = len(trace.entries())
    plan = lms.Plan(fingerprint=trace.fingerprint(), offload=tuple(range(n)), num_entries=n)
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)

    def run(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = step(model, [ids])
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    assert_bitwise(run(contextlib.nullcontext()), run(offload))
    assert offload.stats.offloaded_tensors > 0


def test_tensors_of_the_batch_that_share_a_storage_are_traced_sharing_one():
    """``labels=input_ids``, or a view of them: the step saves one storage, and so does its
    trace, where each fake copy of its own would count and move twice."""
    model = torch.nn.Embedding(100, 8)
    ids = torch.randint(0, 100, (4, 16))

    def step(model, batch):
        out = model(batch["input_ids"]).sum(-1)
        loss = torch.nn.functional.cross_entropy(out.float(), batch["labels"][:, 0] % 15)
        loss.backward()
        return loss

    sizes = {}
    for name, labels in (("same", ids), ("view", ids[:, 1:]), ("copy", ids.clone())):
        batch = {"input_ids": ids, "labels": labels}
        sizes[name] = trace_step(model, batch, step, device="cpu", min_offload_bytes=0).input_bytes
    assert sizes == {"same": ids.nbytes, "view": ids.nbytes, "copy": 2 * ids.nbytes}


class _DrawsOnTheHost(torch.nn.Module):
    """A layer kept or skipped by Python's `random` (layer drop), a time mask from numpy's
    global generator (as speech models draw theirs), and dropout from PyTorch's."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        import random

        import numpy

        keep = torch.from_numpy(numpy.random.uniform(size=(x.shape[0], 1)) > 0.3)
        x = x * keep.to(x.dtype)
        for layer in self.layers:
            if random.random() < 0.5:
                x = self.drop(torch.tanh(layer(x)))
        return x


def test_a_tune_leaves_the_random_generators_as_it_found_them(spill_dir):
    """Note [A trace leaves the random generators as it found them]: seeded alike, the step after
    a tune draws what the step without one does, and the gradients are the same bits."""
    import random

    import numpy

    def seeded(ctx=None):
        torch.manual_seed(0)
        random.seed(0)
        numpy.random.seed(0)
        if ctx is not None:
            ctx.tune(model, [x], lambda m, batch: m(*batch).square().mean().backward())
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]

    model, x = _DrawsOnTheHost(), torch.randn(256, 64)
    ref = seeded()
    offload = lms.LMS(budget="80%", min_offload_bytes=0, spill_dir=spill_dir)
    assert_bitwise(ref, seeded(offload))
    assert offload.plan is not None and offload.stats.diverged_steps == 0
