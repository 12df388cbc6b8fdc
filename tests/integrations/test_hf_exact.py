"""Hugging Face language models train bit for bit under LMS: with everything offloaded, and with
a plan that recomputes what it can; SDPA and eager attention, grouped-query attention, rotary
embeddings, tied embeddings, dropout and a mixture of experts; fp32 and bfloat16 autocast. Tiny
configs, on the CPU."""

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lms  # noqa: E402
from lms.analysis import trace_step  # noqa: E402
from lms.core.recipes import recipes  # noqa: E402
from tests.conftest import assert_bitwise, recomputing_plan  # noqa: E402

CONFIGS = {
    # SDPA, grouped-query attention (2 KV heads for 4), rotary embeddings, tied embeddings,
    # dropout in the attention
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_dropout=0.1,
        attn_implementation="sdpa",
    ),
    # eager attention, learned positions, tied embeddings, dropout everywhere
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, attn_implementation="eager"),
    # SDPA in its math path (a softmax over scores summed with a causal mask made in forward),
    # the tanh-approximated GELU: replays that make the mask and the tanh's input again
    "gpt2-sdpa": dict(n_embd=64, n_layer=2, n_head=4, attn_implementation="sdpa"),
    # a mixture of experts: each token routed to two of four experts by its router's top-k,
    # each expert run on the tokens routed to it (indices the data decides)
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    ),
}


def _model(kind):
    torch.manual_seed(0)
    options = dict(CONFIGS[kind])
    attention = options.pop("attn_implementation")
    config = transformers.AutoConfig.for_model(kind.split("-")[0], vocab_size=256, **options)
    config._attn_implementation = attention
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _step(model, batch, half=False):
    """The model's own loss and its backward; with ``half``, under bfloat16 autocast on the
    batch's device."""
    mixed = torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=half)
    with mixed:
        loss = model(input_ids=batch[0], labels=batch[0]).loss
    loss.backward()
    return loss


def _run(model, ids, half, offload=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with offload if offload is not None else contextlib.nullcontext():
        loss = _step(model, [ids], half)
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("plan", ["everything-offloaded", "recompute"])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt2-sdpa", "mixtral"])
def test_hugging_face_models_train_bitwise(kind, half, plan, spill_dir):
    model = _model(kind)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = _run(model, ids, half)
    if plan == "everything-offloaded":
        settings = {"swapout_threshold": 1, "min_offload_bytes": 1}
        offload = lms.LMS(tier="disk", spill_dir=spill_dir, **settings)
    else:
        traced = trace_step(
            model,
            [ids],
            lambda m, b: _step(m, b, half),
            device="cpu",
            min_offload_bytes=0,
            autocast=torch.bfloat16 if half else None,
        )
        made = recomputing_plan(traced)
        assert made.recompute
        if kind == "gpt2-sdpa":
            replayed = {traced.ops[i].name for r in recipes(traced).values() for i in r.all_ops}
            assert {"aten._safe_softmax.default", "aten.tril.default"} <= replayed
        offload = lms.LMS(plan=made, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(plain, _run(model, ids, half, offload))
    moved = offload.stats.offloaded_tensors + offload.stats.recomputed_tensors
    assert moved > 0
    if plan == "recompute":  # each replay as planned: projections and attention scores too
        assert offload.stats.recomputed_tensors == 2 * len(made.recompute)
    offload.close()


def _follows_a_recomputing_plan(model, batch, spill_dir, caplog):
    """Two steps of ``model(**batch).loss`` under a plan that recomputes what it can, each bit
    for bit the plain step's and none leaving the plan; the plan and the run's statistics."""

    def run(offload=None):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with offload if offload is not None else contextlib.nullcontext():
            loss = model(**batch).loss
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = run()
    plan = recomputing_plan(trace_step(model, batch, device="cpu", min_offload_bytes=0))
    offload = lms.LMS(plan=plan, tier="disk", spill_dir=spill_dir, min_offload_bytes=0)
    with caplog.at_level("WARNING", logger="lms"):
        for _ in range(2):
            assert_bitwise(plain, run(offload))
    assert not [r for r in caplog.records if "own policy" in r.getMessage()]
    assert offload.stats.diverged_steps == 0
    offload.close()
    return plan, offload.stats


class _Wrapped(torch.nn.Module):
    """A user's module around a Hugging Face model (as a Lightning module holds one)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        return self.inner(**batch)


@pytest.mark.parametrize(
    ("padded", "wrapped", "older"),
    [
        (False, False, False),
        (False, True, False),
        (False, False, True),  # a release before Hugging Face's mask checks
        (False, True, True),
        (True, False, False),
        (True, True, False),
    ],
    ids=["ones", "ones-wrapped", "ones-older", "ones-wrapped-older", "padded", "padded-wrapped"],
)
def test_a_tokenizers_batch_is_traced_as_the_step_runs_it(
    padded, wrapped, older, spill_dir, caplog, monkeypatch
):
    """A BatchEncoding with an attention mask and labels, through the default step (the model's
    own loss): with a mask of ones the model builds no mask of its own where it runs, and is
    traced so (Note [A mask of ones is known as such]), inside a module of the user's too, and
    as a release without Hugging Face's mask checks is (the mask traced as none); with padding
    it builds one in both. Either way every step follows the plan, bit for bit."""
    if older:
        from lms.analysis import trace as tracing

        monkeypatch.setattr(tracing, "_MASK_CHECKS", ())
    inner = _model("llama")
    for layer in inner.model.layers:  # without dropout SDPA runs its fused kernel, masked or not
        layer.self_attn.attention_dropout = 0.0
    model = _Wrapped(inner) if wrapped else inner
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, 48:] = 0
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": ids})

    plan, stats = _follows_a_recomputing_plan(model, batch, spill_dir, caplog)
    assert stats.offloaded_tensors == 2 * len(plan.offload) > 0


def test_a_mask_of_ones_the_model_makes_is_traced_as_the_step_runs_it(spill_dir, caplog):
    """BART's decoder, given no mask, makes one of ones and asks whether SDPA can do without it:
    traced, it is known to hold ones and left out as in the step (Note [A mask
    of ones is known as such]), so every step follows the plan, bit for bit."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=256, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).train()
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    _, stats = _follows_a_recomputing_plan(model, batch, spill_dir, caplog)
    assert stats.offloaded_tensors > 0


def _tiny(kind):
    """A tiny model of ``kind`` and a batch for it: BERT (GELU, absolute positions), T5 (RMS
    norms, relative position buckets, an encoder and a decoder), GPT-NeoX (rotary embeddings on
    part of each head, parallel attention and MLP) and ViT (a patch convolution, a class token
    concatenated to the patches)."""
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    if kind == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=256, **shape))
        return model, {"input_ids": ids, "labels": ids}
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            decoder_start_token_id=0,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "labels": ids}
    if kind == "gpt_neox":
        config = transformers.GPTNeoXConfig(vocab_size=256, **shape)
        return transformers.GPTNeoXForCausalLM(config), {"input_ids": ids, "labels": ids}
    config = transformers.ViTConfig(**shape, image_size=32, patch_size=8, num_labels=10)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    batch = {"pixel_values": pixels, "labels": torch.tensor([1, 7])}
    return transformers.ViTForImageClassification(config), batch


@pytest.mark.parametrize("kind", ["bert", "t5", "gpt_neox", "vit"])
def test_what_other_architectures_recompute_is_bitwise(kind, spill_dir, caplog):
    from lms.core.recipes import recipes

    model, batch = _tiny(kind)
    model.train()
    plan, stats = _follows_a_recomputing_plan(model, batch, spill_dir, caplog)
    assert stats.recomputed_tensors == 2 * len(plan.recompute) > 0
    assert stats.replays_differed == 0
    # their matrix products among the replays
    trace = trace_step(model, batch, device="cpu", min_offload_bytes=0)
    found = recipes(trace)
    replayed = {trace.ops[k].name for i in plan.recompute for k in found[i].all_ops}
    assert replayed & {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}, replayed
