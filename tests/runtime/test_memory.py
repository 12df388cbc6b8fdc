"""Memory measured in a fresh process: a tuned plan stays within its budget on the CPU, and the
simulator predicts the growth of the C heap in use within 2%, recomputed chains and the scratch of
convolutions on contiguous tensors included."""

import textwrap

import pytest

from tests.conftest import script_json

pytestmark = pytest.mark.serial  # measured alone (pyproject.toml's markers)

# A channels-last conv stack (one layer: conv, then each of `layer`), its step, and the peak growth
# of the C heap in use over each of three steps (or ``steps``) under an `LMS`
# (`lms.harness.memory`).
COMMON = textwrap.dedent(
    """
    import dataclasses, json, sys, torch, lms
    from lms.harness.memory import PeakMemory
    from lms.analysis import simulate, trace_step
    from lms.orchestration.local import local_device_spec
    torch.manual_seed(0)

    def conv_stack(size, layer):
        layers = []
        for c in (3, 32, 32, 32, 32, 32, 32, 32):
            layers += [torch.nn.Conv2d(c, 32, 3, padding=1), *layer()]
        fmt = torch.channels_last
        model = torch.nn.Sequential(*layers).to(memory_format=fmt)
        return model, torch.randn(1, 3, size, size).contiguous(memory_format=fmt)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    def measured_growth(model, x, offload, steps=3, batch=None, run=None):
        peaks = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            with PeakMemory() as memory:
                with offload:
                    (run or step)(model, batch or [x])
            peaks.append(memory.growth_bytes)
        return peaks
    """
)

SCRIPT = COMMON + textwrap.dedent(
    """
    model, x = conv_stack(512, lambda: [torch.nn.ReLU()])
    budget = int(sys.argv[1]) * 2**20
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[2])
    plan = offload.tune(model, [x], step, cache_dir=sys.argv[2] + "/plans")
    trace = trace_step(model, [x], step, device="cpu")
    sim = simulate(trace, plan, local_device_spec(torch.device("cpu")))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    print(json.dumps({"measured": measured_growth(model, x, offload),
                      "simulated": sim.peak_tensor_bytes - before,
                      "moved": len(plan.offload) + len(plan.recompute), "budget": budget}))
    """
)

CHAINS = COMMON + textwrap.dedent(
    """
    from lms.core.recipes import recipes
    from lms.planning import plan_greedy
    from lms.planning.candidates import Candidates
    from lms.planning.minimum import smallest_plan
    model, x = conv_stack(640, lambda: [torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True)])
    trace = trace_step(model, [x], step, device="cpu")
    # a device whose convolutions are fast next to its copies: replaying beats moving, whatever
    # this machine's spill files measure
    spec = dataclasses.replace(
        local_device_spec(torch.device("cpu")),
        peak_flops=2e12,
        d2h_gbps=1.0,
        h2d_gbps=1.0,
        fresh_read_gbps=None,
    )
    plain = simulate(trace, None, spec)
    try:
        smallest_plan(Candidates(trace, spec, 1))
    except lms.PlanInfeasibleError as error:
        floor = error.min_budget_bytes
    plan = plan_greedy(trace, spec, floor + (plain.peak_bytes - floor) // 10)
    # copies awaited both ways, so that memory does not depend on how fast the disk is
    plan = dataclasses.replace(plan, sync_mode=3)
    found = recipes(trace)
    chained = sum(bool(set(found[i].inputs) & set(plan.recompute)) for i in plan.recompute)
    sim = simulate(trace, plan, spec)
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=sys.argv[1])
    print(json.dumps({"measured": measured_growth(model, x, offload, steps=4),
                      "simulated": sim.peak_tensor_bytes - before,
                      "plain": plain.peak_tensor_bytes - before, "chained": chained}))
    """
)

SCRATCH = COMMON + textwrap.dedent(
    """
    from monai.networks.nets import BasicUNet
    from lms.planning import plan_auto
    # A 3D U-Net on contiguous tensors: oneDNN copies them while each convolution runs (Note
    # [Convolution scratch on the CPU]), at the peak of its step under a plan.
    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(8, 8, 16, 32, 64, 8))
    x = torch.randn(1, 1, 48, 48, 48)
    budget = int(sys.argv[1]) * 2**20
    trace = trace_step(model, [x], step, device="cpu")
    spec = local_device_spec(torch.device("cpu"))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    # copies awaited both ways, so that memory does not depend on how fast the disk is; and the
    # plan a simulation blind to the scratch would follow
    plans = [
        dataclasses.replace(plan_auto(trace, s, budget), sync_mode=3)
        for s in (spec, dataclasses.replace(spec, cpu_scratch=False))
    ]
    plan, blind = plans
    moved = [lms.LMS(plan=p, tier="disk", spill_dir=sys.argv[2]) for p in plans]
    print(json.dumps({"measured": measured_growth(model, x, moved[0]),
                      "simulated": simulate(trace, plan, spec).peak_tensor_bytes - before,
                      "offloaded": len(plan.offload), "budget": budget,
                      "blind": measured_growth(model, x, moved[1]),
                      "blind_simulated": simulate(trace, blind, spec).peak_bytes}))
    """
)

ATROUS = COMMON + textwrap.dedent(
    """
    # DeepLabV3's atrous pooling behind a stem: 3x3 convolutions whose dilation spans more than
    # their 16x16 input, whose backward takes five times the scratch `_cpu_scratch` estimates;
    # the tune's timing process measures it (Note [An op's scratch, measured where it is timed])
    class Atrous(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layers = [torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU()]
            for _ in range(6):
                layers += [torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU()]
            layers += [torch.nn.Conv2d(32, 960, 3, stride=16, padding=1), torch.nn.ReLU()]
            self.stem = torch.nn.Sequential(*layers)
            self.branches = torch.nn.ModuleList(
                torch.nn.Conv2d(960, 256, 3, padding=d, dilation=d, bias=False)
                for d in (12, 24, 36)
            )
            self.head = torch.nn.Conv2d(3 * 256, 21, 1)

        def forward(self, x):
            h = self.stem(x)
            return self.head(torch.cat([b(h).relu() for b in self.branches], 1))

    model, x = Atrous(), torch.randn(2, 3, 256, 256)
    budget = int(sys.argv[1]) * 2**20
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[2])
    plan = offload.tune(model, [x], step, cache_dir=sys.argv[2] + "/plans")
    trace = trace_step(model, [x], step, device="cpu")
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    print(json.dumps({"measured": measured_growth(model, x, offload), "budget": budget,
                      "before": before, "predicted": plan.predicted_peak_bytes - before}))
    """
)

HALF = COMMON + textwrap.dedent(
    """
    import contextlib
    from monai.networks.nets import BasicUNet
    from lms.planning import plan_auto
    # A 3D U-Net under bfloat16 autocast: oneDNN widens what a weight gradient reads to single
    # precision while it runs, and a pointwise convolution's output several times over (Note
    # [Convolution scratch on the CPU]).
    features = (16, 16, 32, 32, 64, 16)
    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=features)
    x = torch.randn(1, 1, 48, 48, 48)
    budget = int(sys.argv[1]) * 2**20
    single = step

    def step(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return single(m, batch)

    trace = trace_step(model, [x], step, device="cpu")
    spec = local_device_spec(torch.device("cpu"))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    plan = dataclasses.replace(plan_auto(trace, spec, budget), sync_mode=3)
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=sys.argv[2])
    print(json.dumps({"plain": measured_growth(model, x, contextlib.nullcontext()),
                      "plain_simulated": simulate(trace, None, spec).peak_tensor_bytes - before,
                      "measured": measured_growth(model, x, offload),
                      "simulated": simulate(trace, plan, spec).peak_tensor_bytes - before,
                      "offloaded": len(plan.offload), "room": budget - before}))
    """
)

PLANLESS = COMMON + textwrap.dedent(
    """
    from lms.analysis.simulate import runtime_plan
    # Wide linear layers on a large batch: the weights and the batch take a good part of the
    # budget, which the runtime's own policy counts (Note [What a budget on the CPU starts from]).
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
    model, x = torch.nn.Sequential(*layers), torch.randn(8192, 512)
    budget = int(sys.argv[1]) * 2**20
    trace = trace_step(model, [x], step, device="cpu")
    plan = runtime_plan(trace, budget)
    sim = simulate(trace, plan, local_device_spec(torch.device("cpu")))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[2])
    measured, moved = [], []
    for _ in range(3):
        done = offload.stats.offloaded_tensors
        measured += measured_growth(model, x, offload, steps=1)
        moved.append(offload.stats.offloaded_tensors - done)
    print(json.dumps({"measured": measured, "moved": moved, "planned": len(plan.offload),
                      "simulated": sim.peak_tensor_bytes - before, "before": before,
                      "budget": budget}))
    """
)

GRAPH = COMMON + textwrap.dedent(
    """
    import gc
    from lms.harness.memory import heap_in_use_bytes
    # 100 small layers: 303 forward ops, 4 KiB tensors, so that the autograd graph's share of
    # the heap is as large as the tensors' (Note [The autograd graph on a CPU's heap]).
    layers = []
    for _ in range(100):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    model, x = torch.nn.Sequential(*layers), torch.randn(16, 64)
    trace = trace_step(model, [x], step, device="cpu")
    spec = local_device_spec(torch.device("cpu"))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes

    def at_backward(spec):
        result = simulate(trace, None, spec)
        return result.peak_after(result.backward_start_s)[0] - before

    measured = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        gc.collect()
        start = heap_in_use_bytes()
        loss = model(x).square().mean()
        measured.append(heap_in_use_bytes() - start)
        loss.backward()
        del loss
    print(json.dumps({"measured": measured, "simulated": at_backward(spec),
                      "tensors": at_backward(dataclasses.replace(spec, graph_bytes_per_op=0))}))
    """
)


# A ResNet18 step tuned for a budget on the disk tier, three steps; the peak growth of the
# resident set over all three and of the heap in use over each (Note [The resident set follows
# the heap under a budget]).
RESIDENT = textwrap.dedent(
    """
    import json, logging, sys, torch, torchvision, lms
    from lms.harness.memory import PeakMemory
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x, y = torch.randn(4, 3, 256, 256), torch.randint(0, 1000, (4,))

    def step(m, batch):
        loss = torch.nn.functional.cross_entropy(m(batch[0]), batch[1])
        loss.backward()
        return loss

    budget = int(sys.argv[1]) * 2**20
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[2])
    offload.tune(model, [x, y], step, cache_dir=None)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lms").addHandler(handler)
    logging.getLogger("lms").setLevel(logging.INFO)
    heap = []
    with PeakMemory() as whole:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with PeakMemory() as memory:
                with offload:
                    step(model, [x, y])
            heap.append(memory.heap_growth_bytes)
    print(json.dumps({"resident": whole.rss_growth_bytes, "heap": heap, "budget": budget,
                      "held": sum(t.nbytes for t in [*model.parameters(), x, y]),
                      "lines": lines}))
    """
)


def test_tuned_plan_keeps_heap_growth_within_budget_and_prediction(tmp_path):
    result = script_json(SCRIPT, "200", str(tmp_path))
    # Offloaded or recomputed, as this machine's measured rates favour: either way the plan
    # moves something to fit.
    assert result["moved"] > 0
    assert max(result["measured"]) <= result["budget"], result  # the first step too
    assert abs(max(result["measured"][1:]) / result["simulated"] - 1) <= 0.02, result


LSTM = COMMON + textwrap.dedent(
    """
    # A two-layer LSTM language model: once its plan moves oneDNN's workspaces out, the layers'
    # backward scratch is the step's peak (Note [An LSTM's backward scratch on the CPU])
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 256)
            self.rnn = torch.nn.LSTM(256, 256, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(256, 1000)

        def forward(self, x):
            return self.head(self.rnn(self.embed(x))[0])

    def lm_step(m, batch):
        loss = torch.nn.functional.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten())
        loss.backward()
        return loss

    model = LM()
    x, y = torch.randint(0, 1000, (4, 512)), torch.randint(0, 1000, (4, 512))
    from lms.planning.candidates import Candidates
    spec = local_device_spec(torch.device("cpu"))
    trace = trace_step(model, [x, y], lm_step, device="cpu")
    candidates = Candidates(trace, spec, budget_bytes=2**40)
    plan = candidates.plan(range(candidates.num_entries), source="test")  # everything offloaded
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=sys.argv[1])
    sim = simulate(trace, plan, spec)
    blind = simulate(trace, plan, dataclasses.replace(spec, cpu_scratch=False))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    measured = measured_growth(model, x, offload, batch=[x, y], run=lm_step)
    print(json.dumps({"measured": measured, "simulated": sim.peak_tensor_bytes - before,
                      "blind": blind.peak_tensor_bytes - before, "moved": len(plan.offload)}))
    """
)


def test_an_lstms_backward_scratch_is_simulated(tmp_path):
    result = script_json(LSTM, str(tmp_path))
    assert result["moved"] > 0
    steady = max(result["measured"][1:])
    # with every saved storage offloaded the layers' backward scratch is the step's peak: a
    # simulation blind to it came out 14% short
    assert steady > 1.1 * result["blind"], result
    assert abs(steady / result["simulated"] - 1) <= 0.03, result


def test_recomputed_chains_grow_the_heap_as_simulated(tmp_path):
    result = script_json(CHAINS, str(tmp_path))
    assert result["chained"] > 0
    later = result["measured"][1:]  # the first step also checks each replay's bits
    assert max(later) < result["plain"] / 2, result
    # The median of three: in full runs of the suite, one step in several measured one
    # activation (52 MB) more than the others, at random, a cause not confirmed (the I/O
    # thread's references after a copy could give it and are gone: Note [The I/O thread lets
    # go of a storage before it says it is done]); run alone, loaded or not, every step
    # measures the same.
    steady = sorted(later)[1]
    assert abs(steady / result["simulated"] - 1) <= 0.02, result


def test_contiguous_convolutions_scratch_is_simulated_and_kept_within_budget(tmp_path):
    result = script_json(SCRATCH, "120", str(tmp_path))
    assert result["offloaded"] > 0
    # The first step also allocates what stays allocated after it (16 MiB here: state PyTorch's
    # convolutions make once).
    steady = max(result["measured"][1:])
    assert steady <= result["budget"], result
    assert abs(steady / result["simulated"] - 1) <= 0.02, result
    # A plan made blind to the scratch goes over the budget, as simulated with it.
    assert max(result["blind"][1:]) > result["budget"] < result["blind_simulated"], result
    assert abs(max(result["blind"][1:]) / (result["blind_simulated"] - 2**20 * 1.8) - 1) < 0.05


def test_scratch_the_timing_process_measures_keeps_a_plan_within_its_budget(tmp_path):
    result = script_json(ATROUS, "200", str(tmp_path))
    # Tuned on the estimates alone, this plan grew the heap by 223.8 MB, past the budget of
    # 209.7 MB with the 29.5 MB of weights and batch.
    assert max(result["measured"]) + result["before"] <= result["budget"], result
    assert abs(max(result["measured"][1:]) / result["predicted"] - 1) <= 0.02, result


DEPTHWISE = COMMON + textwrap.dedent(
    """
    import contextlib
    # Depthwise convolutions with 5x5 and 7x7 kernels in the channels-last layout (EfficientNet's,
    # ConvNeXt's): oneDNN makes each weight gradient a whole block of channels wide, hundreds of
    # times its own bytes (Note [Convolution scratch on the CPU])
    c = 240
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 1), torch.nn.Conv2d(c, c, 5, padding=2, groups=c), torch.nn.SiLU(),
        torch.nn.Conv2d(c, c, 7, padding=3, groups=c),
    ).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    half = sys.argv[1] == "bfloat16"  # under autocast: the gradient also in half, and activations
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=half)
    trace = trace_step(model, [x], step, device="cpu", autocast=torch.bfloat16 if half else None)
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    spec = local_device_spec(torch.device("cpu"))
    sim = simulate(trace, None, spec, half=half)
    print(json.dumps({"measured": measured_growth(model, x, autocast, steps=5),
                      "simulated": sim.peak_tensor_bytes - before}))
    """
)


def _cpu_has(flag: str) -> bool:
    """Whether this CPU lists ``flag`` (AVX-512, whose oneDNN kernels block channels by 16; AMX
    tiles for bfloat16, whose kernels take other scratch)."""
    try:
        with open("/proc/cpuinfo") as info:
            return flag in info.read().split()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has("avx512f"), reason="measured with AVX-512's 16-channel blocks")
@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(
                _cpu_has("amx_bf16"), reason="measured with AVX-512 BF16 and no AMX"
            ),
        ),
    ],
)
def test_wide_depthwise_kernels_weight_gradients_are_simulated(dtype):
    result = script_json(DEPTHWISE, dtype)
    steady = max(result["measured"][1:])
    # 17.3 MiB of padded weight gradients beside 1.9 MiB activations in single precision (in
    # half, 26 MiB more): most of the step's peak, which a simulation without them misses
    assert steady > 10 * 2**20 and abs(steady / result["simulated"] - 1) <= 0.05, result


SHALLOW = COMMON + textwrap.dedent(
    """
    import contextlib
    # A video network's last stage: 3D convolutions over two frames at batch 2, whose weight
    # gradients oneDNN makes in several partial copies (Note [Convolution scratch on the CPU])
    torch.set_num_threads(2)
    c = 256
    model = torch.nn.Sequential(
        torch.nn.Conv3d(c, c, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(c, c, 3, padding=1)
    )
    x = torch.randn(2, c, 2, 7, 7)
    trace = trace_step(model, [x], step, device="cpu")
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    spec = local_device_spec(torch.device("cpu"))
    print(json.dumps({"measured": measured_growth(model, x, contextlib.nullcontext(), steps=4),
                      "simulated": simulate(trace, None, spec).peak_tensor_bytes - before,
                      "weights": trace.param_bytes}))
    """
)


@pytest.mark.skipif(not _cpu_has("avx512f"), reason="measured with AVX-512's kernels")
def test_shallow_3d_weight_gradients_are_simulated():
    result = script_json(SHALLOW)
    steady = max(result["measured"][1:])
    # the weight gradient's copies (8 times the layer's 7 MiB of weights on two threads) are
    # the step's peak: a simulation without them is a quarter of it
    assert steady > 2 * result["weights"], result
    assert steady <= result["simulated"] <= 1.25 * steady, result


ONE_ROW = COMMON + textwrap.dedent(
    """
    import contextlib
    # A speech model's front end: 1D convolutions from the raw signal, strided, which PyTorch runs
    # as 2D ones over a single row, then a positional one of 128 taps, whose weight gradient
    # oneDNN makes in several copies (Note [Convolution scratch on the CPU])
    torch.set_num_threads(2)
    c = 256
    model = torch.nn.Sequential(
        torch.nn.Conv1d(1, c, 10, stride=5), torch.nn.GELU(),
        torch.nn.Conv1d(c, c, 3, stride=2), torch.nn.GELU(), torch.nn.Conv1d(c, c, 3, stride=2),
        torch.nn.Conv1d(c, c, 128, padding=64, groups=4),
    )
    x = torch.randn(4, 1, 16000).requires_grad_()  # as the Hugging Face wav2vec2 asks
    trace = trace_step(model, [x], step, device="cpu")
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    spec = local_device_spec(torch.device("cpu"))
    blind = dataclasses.replace(spec, cpu_scratch=False)
    print(json.dumps({"measured": measured_growth(model, x, contextlib.nullcontext(), steps=4),
                      "simulated": simulate(trace, None, spec).peak_tensor_bytes - before,
                      "blind": simulate(trace, None, blind).peak_tensor_bytes - before}))
    """
)


@pytest.mark.skipif(not _cpu_has("avx512f"), reason="measured with AVX-512's 16-channel blocks")
def test_one_dimensional_convolutions_scratch_is_simulated():
    result = script_json(ONE_ROW)
    steady = max(result["measured"][1:])
    # the strided backward takes twice its input, the first layer's half as much again as its
    # output gradient, and the positional one's weight gradient two copies of four times its
    # weights: half of the step's peak, which a simulation blind to them misses
    assert steady > 1.3 * result["blind"], result
    assert abs(steady / result["simulated"] - 1) <= 0.05, result


# The bfloat16 scratch estimates (Note [Convolution scratch on the CPU]) were measured on a CPU
# with AVX-512 BF16 and no AMX. With AMX, oneDNN's bfloat16 convolution backward takes other
# scratch: a 32->16 channel 3x3x3 backward at 48^3 took 5.5 MiB more than estimated, a 64->32
# one 15 MiB less (benchmarks/results/README.md, "Convolution scratch on the CPU"), and the plain
# step of this test peaks 5.9% over its simulation there.
@pytest.mark.skipif(_cpu_has("amx_bf16"), reason="bfloat16 scratch is not yet modelled for AMX")
def test_half_precision_convolutions_scratch_is_simulated_and_kept_within_budget(tmp_path):
    """Note [Convolution scratch on the CPU]: under bfloat16 autocast the heap grows as simulated,
    with and without a plan (the estimates for single precision fell 9% short of the plain step)."""
    result = script_json(HALF, "70", str(tmp_path))
    assert result["offloaded"] > 0
    for measured, simulated in (("plain", "plain_simulated"), ("measured", "simulated")):
        steady = max(result[measured][1:])
        assert abs(steady / result[simulated] - 1) <= 0.03, result
    assert max(result["measured"][1:]) <= result["room"] * 1.01, result


def test_the_policy_without_a_plan_counts_weights_and_batch_as_simulated(tmp_path):
    """Note [What a budget on the CPU starts from]: from its second step the runtime's own policy
    moves what `runtime_plan` simulates it moving, and the heap grows no more than simulated
    (before, it counted none of the 28 MiB of weights and batch, moved 6 storages where 8 were
    simulated, and grew 17 MiB past the simulation)."""
    result = script_json(PLANLESS, "160", str(tmp_path))
    assert result["planned"] > 0
    assert result["moved"][1:] == [result["planned"]] * 2, result
    assert max(result["measured"][1:]) <= result["simulated"], result


def test_the_heap_holds_the_autograd_graph_beside_the_tensors_as_simulated():
    """Note [The autograd graph on a CPU's heap]: after forward the heap holds the graph beside
    the saved tensors, more than the tensors alone simulate and no more than the spec counts."""
    result = script_json(GRAPH)
    steady = result["measured"][1:]  # the first step also makes what later steps reuse
    assert result["tensors"] < min(steady) <= max(steady) <= result["simulated"], result


def test_a_cpu_budget_holds_for_the_resident_set(tmp_path):
    """Note [The resident set follows the heap under a budget]: the process's resident set grows
    over three steps no more than the heap in use does within each, which the budget holds, and
    what the first step maps once outside the heap (code it runs for the first time, thread
    stacks; here up to 20 MiB). With glibc's own setting this step's resident set grew by up to
    237 MiB where the heap grew by 143."""
    result = script_json(RESIDENT, "200", str(tmp_path))
    assert any("holds for this process's resident set" in line for line in result["lines"])
    assert max(result["heap"]) <= result["budget"] - result["held"], result
    assert result["resident"] <= max(result["heap"]) + 32 * 2**20, result


PENALTY = textwrap.dedent(
    """
    import json, sys, torch, lms
    from lms.analysis import simulate, trace_step
    from lms.harness.memory import PeakMemory
    from lms.analysis.simulate import library_kept_bytes
    from lms.orchestration.local import local_device_spec, with_local_timings
    from lms.orchestration.tuning import priced_spec
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
        torch.nn.GELU(), torch.nn.Linear(1024, 1)
    )
    x = torch.randn(4096, 64)

    def penalty(m, batch):  # an R1 gradient penalty: a double backward
        x = batch[0].clone().requires_grad_()
        out = m(x).sum()
        (grad,) = torch.autograd.grad(out, x, create_graph=True)
        loss = out + grad.square().sum()
        loss.backward()
        return loss.detach()

    trace = trace_step(model, [x], penalty, device="cpu", min_offload_bytes=0)
    plain = simulate(trace, None, local_device_spec(torch.device("cpu"))).peak_bytes
    # Note [Buffers a library keeps]: MKL's, which the first step's products allocate
    timed = with_local_timings(priced_spec(torch.device("cpu")), trace, torch.device("cpu"))
    kept = library_kept_bytes(trace, timed)
    budget = int(0.9 * plain) + kept
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[1], min_offload_bytes=0,
                      cpu_resident=False)
    plan = offload.tune(model, [x], penalty, cache_dir=sys.argv[1] + "/plans")
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    measured = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with PeakMemory() as memory:
            with offload:
                penalty(model, [x])
        measured.append(memory.growth_bytes)
    print(json.dumps({"measured": measured, "simulated": plan.predicted_peak_bytes - before,
                      "budget": budget - before, "moved": len(plan.offload),
                      "kept": kept,
                      "diverged": offload.stats.diverged_steps}))
    """
)


def test_a_double_backwards_plan_keeps_heap_growth_within_budget_and_prediction(tmp_path):
    """Note [What backward makes and saves]: a gradient penalty planned under its plain peak."""
    result = script_json(PENALTY, str(tmp_path))
    assert result["moved"] > 0 and result["diverged"] == 0, result
    assert max(result["measured"]) <= result["budget"], result  # the first step too
    assert abs(max(result["measured"][1:]) / result["simulated"] - 1) <= 0.02, result
    # the first step also allocates the buffers MKL keeps from then on
    first = result["simulated"] + result["kept"]
    assert abs(result["measured"][0] / first - 1) <= 0.02, result
