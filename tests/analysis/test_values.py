"""A traced step that reads values: of its labels, its masks, its lengths (Note [A value the step
reads is computed for real])."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import lms
import lms.analysis.values as values_module
from lms.analysis import trace_step
from lms.analysis.values import Values
from tests.conftest import assert_bitwise, recomputing_plan, run_step


class KeptLabels(nn.Module):
    """Scores only the labels it keeps (``labels >= 0``), after checking them, as DeBERTa's
    classification loss does."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 5)

    def forward(self, x, labels):
        if labels.max() >= 5:
            raise ValueError("a label past the classes")
        kept = (labels >= 0).nonzero().squeeze(-1)
        logits = self.head(self.body(x))
        return F.cross_entropy(logits[kept], labels[kept])


class Ctc(nn.Module):
    """A CTC loss over lengths read from a mask, as Hugging Face's Wav2Vec2 takes them."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 32, 9, stride=4)
        self.out = nn.Linear(32, 12)

    def forward(self, audio, mask, labels):
        hidden = F.gelu(self.conv(audio.unsqueeze(1))).transpose(1, 2)
        log_probs = self.out(hidden).log_softmax(-1).transpose(0, 1)
        lengths = ((mask.sum(-1) - 9) // 4 + 1).long()
        kept = labels >= 0
        targets = labels.masked_select(kept)
        return F.ctc_loss(log_probs, targets, lengths, kept.sum(-1))


class MaskedSteps(nn.Module):
    """Replaces the time steps a boolean mask of the batch picks with a learned vector, as Hugging
    Face's Wav2Vec2 does in training (whose backward gathers that vector's gradient with the same
    mask), and scores the activations of the steps it picks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(32))
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.out = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())

    def forward(self, x, mask):
        hidden = self.body(x)
        hidden[mask] = self.embed
        return self.out(hidden)[mask].square().mean()


class Packed(nn.Module):
    """A recurrent layer over sequences of different lengths, packed and padded back, as
    variable-length batches go into one (Note [A packed sequence's batch sizes are real])."""

    def __init__(self, kind):
        super().__init__()
        bidirectional = kind == "GRU"
        self.embed = nn.Embedding(50, 16)
        self.rnn = getattr(nn, kind)(16, 24, 2, batch_first=True, bidirectional=bidirectional)
        self.out = nn.Linear(24 * (2 if bidirectional else 1), 3)

    def forward(self, tokens, lengths, labels):
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        padded, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return F.cross_entropy(self.out(padded.sum(1)), labels)


def _packed_batch():
    """Five sequences of 3 to 12 tokens, as `Packed` takes them, with their labels."""
    return [
        torch.randint(0, 50, (5, 12)),
        torch.tensor([7, 12, 3, 9, 12]),
        torch.tensor([0, 2, 1, 1, 0]),
    ]


def _step(model, batch):
    loss = model(*batch)
    loss.backward()
    return loss.detach()


def _run(model, batch, offload=None):
    """The step, plainly or under ``offload``: its loss and gradients."""
    return run_step(model, batch, offload, loss_fn=lambda loss: loss)


def _labels_batch(rows=64):
    torch.manual_seed(0)
    return [torch.randn(rows, 16), torch.tensor([0, -1, 4, 2, -1, 3, 1, -100] * (rows // 8))]


def _ctc_batch():
    torch.manual_seed(0)
    mask = torch.ones(4, 400, dtype=torch.long)
    mask[1, 300:] = 0
    labels = torch.randint(1, 12, (4, 10))
    labels[2, 6:] = -100
    return [torch.randn(4, 400), mask, labels]


def _masked_batch():
    torch.manual_seed(0)
    return [torch.randn(4, 50, 16), torch.rand(4, 50) < 0.3]


@pytest.mark.parametrize(("make", "batch"), [(KeptLabels, _labels_batch), (Ctc, _ctc_batch)])
def test_a_step_reading_its_labels_traces_and_its_plan_is_bitwise(make, batch, tmp_path):
    torch.manual_seed(0)
    model, given = make(), batch()
    ref = _run(model, given)
    trace = trace_step(model, given, _step, device="cpu", min_offload_bytes=0)
    plan = recomputing_plan(trace)
    assert plan.offload and plan.recompute
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(ref, _run(model, given, offload))
    assert offload.stats.diverged_steps == 0  # the trace saved what the real steps save
    assert offload.stats.recomputed_tensors
    offload.close()


@pytest.mark.parametrize(("kind", "limit"), [("LSTM", None), ("GRU", 64)])
def test_a_recurrent_layer_on_packed_sequences_traces_and_its_plan_is_bitwise(
    kind, limit, monkeypatch, tmp_path
):
    """Note [A packed sequence's batch sizes are real]: with ``limit``, the activations packed
    are past what the trace computes for real, and packing still runs on zeros for them. No
    replay reads a chunk of the cells' gates changed since its op read it (Note [A replay reads
    what its op read]); a step that the gates' copies put an ordinal off its plan leaves it
    before it replays another storage's recipe (Note [A step is checked where its plan
    recomputes])."""
    if limit is not None:
        monkeypatch.setattr(values_module, "REAL_ELEMENTS", limit)
    torch.manual_seed(0)
    model = Packed(kind)
    batch = _packed_batch()
    ref = _run(model, batch)
    trace = trace_step(model, batch, _step, device="cpu", min_offload_bytes=0)
    # each time step runs the rows still going, as the lengths set them: 5, 4, 3 or 2
    gates = 4 if kind == "LSTM" else 3
    rows = {
        op.written_bytes // (gates * 24 * 4)
        for op in trace.ops
        if op.name == "aten.addmm.default" and op.module.endswith(".rnn") and op.phase == "forward"
    }
    assert {2, 3, 4, 5} <= rows
    plan = recomputing_plan(trace)
    assert plan.offload and plan.recompute
    assert plan.entry_bytes == tuple(size for _, size, _ in trace.entries())
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(ref, _run(model, batch, offload))
    assert offload.stats.replays_differed == 0
    offload.close()


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_recurrent_layer_on_packed_sequences_keeps_to_a_plan_that_offloads(kind, tmp_path):
    """Note [A storage copied again keeps its place in the plan]: the cells' gates saved again
    after their storage went out, and the indices that unsort the sequences saved again after
    autograd let go of them, are twins of their entries; the step keeps to the plan."""
    from lms.analysis import device_spec
    from lms.planning.candidates import Candidates

    torch.manual_seed(0)
    model = Packed(kind)
    batch = _packed_batch()
    ref = _run(model, batch)
    trace = trace_step(model, batch, _step, device="cpu", min_offload_bytes=0)
    candidates = Candidates(trace, device_spec("cpu"), budget_bytes=2**40)
    plan = candidates.plan(range(candidates.num_entries), source="test")
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(ref, _run(model, batch, offload))
    assert plan.offload and offload.stats.diverged_steps == 0
    offload.close()


def test_the_kept_labels_shape_the_trace_as_they_shape_the_step():
    model, given = KeptLabels(), _labels_batch()
    trace = trace_step(model, given, _step, device="cpu", min_offload_bytes=0)
    kept = int((given[1] >= 0).sum())
    picked = [op for op in trace.ops if op.name == "aten.index.Tensor" and op.phase == "forward"]
    assert picked and picked[0].written_bytes == kept * 5 * 4  # the kept rows of the logits


def test_a_wrong_label_raises_the_models_own_error():
    model, (x, labels) = KeptLabels(), _labels_batch()
    labels[3] = 7
    with pytest.raises(lms.StepFailedError, match="a label past the classes"):
        trace_step(model, [x, labels], _step, device="cpu")


def test_a_value_of_the_activations_past_the_limit_is_still_refused(monkeypatch):
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            hidden = self.lin(x)
            return hidden[hidden > 0].sum()  # which activations are kept depends on them

    model, x = Reads(), torch.randn(32, 16)
    trace_step(model, [x], device="cpu")  # small: run for real
    monkeypatch.setattr(values_module, "REAL_ELEMENTS", 100)
    with pytest.raises(lms.StepFailedError, match="depends on the data"):
        trace_step(model, [x], device="cpu")
    with pytest.raises(lms.StepFailedError, match="depends on the data"):
        trace_step(Reads, [x], device="cpu")  # built under fake tensors: no weights to read


def test_a_boolean_mask_of_the_batch_shapes_an_index_of_the_activations(monkeypatch, tmp_path):
    # activations past the limit, whose values the trace cannot have: the mask's alone shape
    # what forward picks of them, and what backward gathers of their gradient
    monkeypatch.setattr(values_module, "REAL_ELEMENTS", 4000)
    model, given = MaskedSteps(), _masked_batch()
    ref = _run(model, given)
    trace = trace_step(model, given, _step, device="cpu", min_offload_bytes=0)
    kept = int(given[1].sum())
    picked = [op for op in trace.ops if op.name == "aten.index.Tensor"]
    assert [op.written_bytes for op in picked] == [kept * 32 * 4] * 2, picked
    assert {op.phase for op in picked} == {"forward", "backward"}
    plan = recomputing_plan(trace)
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=str(tmp_path), min_offload_bytes=0)
    assert_bitwise(ref, _run(model, given, offload))
    assert offload.stats.diverged_steps == 0 and offload.stats.recomputed_tensors
    offload.close()


def test_values_follow_writes_in_place_and_forget_a_storage_written_through_a_view():
    real = torch.tensor([0, -1, 2, 1, -1, 3])
    values = Values()

    class Through(TorchDispatchMode):  # as the trace's recorder runs each op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return values.call(func, args, kwargs or {})

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(real)
        values.know(fake, real)
        with Through():
            copied = fake.clone()
            copied.masked_fill_(copied == 1, -1)  # written in place: followed
            assert (copied >= 0).nonzero().shape == (3, 1)
            copied[:2].fill_(5)  # written through a view: its base is not known any more
            with pytest.raises(Exception, match="nonzero"):
                (copied >= 0).nonzero()
    assert torch.equal(real, torch.tensor([0, -1, 2, 1, -1, 3]))  # the real value untouched


def test_a_random_value_read_puts_the_generator_back():
    class Drops(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x[torch.rand(x.shape[0]) > 0.5]).sum()

    model, x = Drops(), torch.randn(64, 8)
    state = torch.random.get_rng_state()
    trace = trace_step(model, [x], device="cpu")
    assert any(op.name == "aten.index.Tensor" for op in trace.ops)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_ops_that_fail_for_real_leave_the_value_unknown(monkeypatch):
    def fails(node):  # as an op that runs on the device alone would on the CPU
        raise RuntimeError("not on this device")

    monkeypatch.setattr(values_module, "_run", fails)
    with pytest.raises(lms.StepFailedError, match="depends on the data"):
        trace_step(KeptLabels(), _labels_batch(), _step, device="cpu")
