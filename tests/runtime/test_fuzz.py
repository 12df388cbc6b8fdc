"""Every model that trains without LMS trains with it, bit for bit: random small models built from
a vocabulary of layers and ops, each checked with everything offloaded to spill files, with a
plan the planner made, and with a plan that recomputes what it can."""

import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.planning import plan_greedy
from tests.conftest import assert_bitwise, recomputing_plan, run_step

WIDTH = 16
BATCH = 4


class _Swish(torch.autograd.Function):
    """A custom Function that saves its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class _Block(torch.nn.Module):
    """One layer of the vocabulary, mapping (BATCH, WIDTH) to (BATCH, WIDTH)."""

    def __init__(self, kind: str, shared: torch.nn.Linear):
        super().__init__()
        self.kind = kind
        if kind == "lazy":
            self.layer = torch.nn.LazyLinear(WIDTH)
        elif kind == "shared":  # a weight two blocks hold (tied)
            self.layer = shared
        elif kind == "layernorm":
            self.layer = torch.nn.LayerNorm(WIDTH)
        elif kind == "batchnorm":
            self.layer = torch.nn.BatchNorm1d(WIDTH)
        elif kind == "groupnorm":
            self.layer = torch.nn.GroupNorm(4, WIDTH)
        elif kind == "dropout":
            self.layer = torch.nn.Dropout(0.3)
        elif kind == "attention":
            self.layer = torch.nn.Linear(WIDTH, 3 * WIDTH)
        elif kind == "branch":
            self.layer = torch.nn.Linear(WIDTH, WIDTH)
            self.other = torch.nn.Linear(WIDTH, WIDTH)
        else:
            self.layer = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        kind = self.kind
        if kind == "inplace":
            return torch.relu_(self.layer(x))
        if kind == "view":
            y = self.layer(x).view(BATCH, 2, WIDTH // 2).transpose(1, 2)
            return y.reshape(BATCH, WIDTH).tanh()
        if kind == "branch":  # a junction: x feeds two branches and the sum
            return self.layer(x).sigmoid() * self.other(x) + x
        if kind == "attention":
            q, k, v = self.layer(x).view(BATCH, 4, 3 * WIDTH // 4).chunk(3, dim=-1)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return y.reshape(BATCH, WIDTH) + x
        if kind == "custom":
            return _Swish.apply(self.layer(x))
        if kind == "slices":  # two saved views of one storage
            y = self.layer(x)
            return torch.cat([y[:, : WIDTH // 2].exp(), y[:, WIDTH // 2 :].sin()], dim=1)
        if kind == "resample":  # a decoder's: upsampled, pooled back, a mobile net's activation
            y = self.layer(x).view(BATCH, 4, 2, 2)
            y = torch.nn.functional.interpolate(y, scale_factor=2, mode="bilinear")
            y = torch.nn.functional.avg_pool2d(torch.nn.functional.hardswish(y), 2)
            y = torch.nn.functional.interpolate(y.reshape(BATCH, 1, WIDTH), scale_factor=2)
            return y.view(BATCH, WIDTH, 2).mean(-1)
        if kind == "smooth":
            return torch.nn.functional.mish(torch.nn.functional.elu(self.layer(x)))
        if kind in ("layernorm", "batchnorm", "groupnorm", "dropout"):
            return self.layer(x)
        return self.layer(x).relu()


KINDS = [
    "linear",
    "lazy",
    "inplace",
    "view",
    "branch",
    "dropout",
    "layernorm",
    "batchnorm",
    "attention",
    "shared",
    "custom",
    "slices",
    "groupnorm",
    "resample",
    "smooth",
]


def _build(kinds: tuple[str, ...], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    shared = torch.nn.Linear(WIDTH, WIDTH)
    head = torch.nn.Linear(WIDTH, WIDTH)  # every model has a weight to train
    return torch.nn.Sequential(*[_Block(kind, shared) for kind in kinds], head)


def _step(model, batch):
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


@pytest.fixture(scope="module")
def fuzz_spill_dir(tmp_path_factory):
    # Each trace collects garbage once (what reference cycles keep, before it reads what the
    # step's code holds); frozen, the test process's own objects are not walked each time.
    gc.collect()
    gc.freeze()
    yield str(tmp_path_factory.mktemp("fuzz-spill"))
    gc.unfreeze()


models = st.tuples(
    st.lists(st.sampled_from(KINDS), min_size=2, max_size=7).map(tuple),
    st.integers(0, 2**16),
)


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(model=models)
def test_random_models_train_bitwise_under_every_kind_of_plan(model, fuzz_spill_dir):
    kinds, seed = model
    spill_dir = fuzz_spill_dir
    torch.manual_seed(seed)
    batch = (torch.randn(BATCH, WIDTH),)
    reference = _build(kinds, seed)
    plain = run_step(reference, batch)  # also makes the lazy modules' parameters

    # Everything offloaded to spill files, the model as built (lazy modules not yet made).
    fresh = _build(kinds, seed)
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, swapout_threshold=1, min_offload_bytes=1)
    assert_bitwise(plain, run_step(fresh, batch, offload))
    offload.close()

    # The lazy modules made their parameters in the first step, drawing from the random stream
    # ahead of dropout; the plans below run on the model as it is now.
    plain = run_step(reference, batch)
    trace = trace_step(reference, batch, _step, device="cpu", min_offload_bytes=0)
    spec = device_spec("cpu")
    peak = simulate(trace, None, spec).peak_bytes
    # A plan the planner made, for a budget under the step's peak where one fits.
    try:
        planned = plan_greedy(trace, spec, int(peak * 0.9), max_simulations=60)
    except lms.PlanInfeasibleError:
        planned = plan_greedy(trace, spec, peak, max_simulations=60)
    # A plan that recomputes every tensor it can from stored inputs, and offloads the rest.
    for plan in (planned, recomputing_plan(trace)):
        offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
        assert_bitwise(plain, run_step(reference, batch, offload))
        offload.close()
