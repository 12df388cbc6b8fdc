"""The transformers.Trainer integration: each micro-batch in one block, tuned before the first,
bitwise with the plain Trainer, and a budget no plan fits refused before any weight changes."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # what Trainer needs

import lms  # noqa: E402
from lms.analysis import device_spec, trace_step  # noqa: E402
from lms.integrations.transformers import offload_trainer  # noqa: E402
from tests.conftest import hooks_are_gone, midway_budget, same_bits, spill_files  # noqa: E402

STEPS, ACCUMULATE = 2, 2


def _model():
    config = transformers.AutoConfig.for_model(
        "gpt2", vocab_size=500, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )  # with dropout
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _data():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (8, 64), generator=generator)
    return [
        {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids
    ]


def _padded(rows):
    """Rows padded to the longest in their batch, as a tokenizer's collator pads them."""
    longest = max(len(row["input_ids"]) for row in rows)

    def pad(row, key, value):
        return torch.nn.functional.pad(row[key], (0, longest - len(row[key])), value=value)

    return {
        "input_ids": torch.stack([pad(row, "input_ids", 0) for row in rows]),
        "attention_mask": torch.stack([pad(row, "attention_mask", 0) for row in rows]),
        "labels": torch.stack([pad(row, "labels", -100) for row in rows]),
    }


def _lengths():
    """Rows of 40 and 64 tokens: batches padded to either."""
    rows = _data()
    for row in rows[::2]:
        row.update({key: value[:40] for key, value in row.items()})
    return rows


def _llama():
    """A Llama, whose masks look for packed sequences where a row comes without one."""
    config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _trainer(folder, dataset=None, collator=None, model=_model):
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return transformers.Trainer(
        model=model(), args=args, train_dataset=dataset or _data(), data_collator=collator
    )


def _budget(model=_model):
    batch = transformers.default_data_collator(_data()[:2])

    def step(model, inputs):
        model(**inputs).loss.backward()

    traced = trace_step(model(), batch, step, device="cpu", min_offload_bytes=0)
    return midway_budget(traced, device_spec("cpu"))


def _both_trained(tmp_path, dataset=_data, collator=None, model=_model):
    """A plain Trainer and one under `offload_trainer` at `_budget`, each trained; the second's
    LMS object and spill folder."""
    budget = _budget(model)  # before the trainers: Trainer seeds the generator dropout draws from
    plain = _trainer(tmp_path / "plain", dataset(), collator, model)
    plain.train()
    trainer = _trainer(tmp_path / "lms", dataset(), collator, model)
    spill = tmp_path / "spill"
    spill.mkdir()
    offload = offload_trainer(
        trainer,
        budget=budget,
        min_offload_bytes=0,
        spill_dir=str(spill),
        cache_dir=str(tmp_path / "plans"),
    )
    trainer.train()
    return plain, trainer, offload, spill


def test_each_micro_batch_follows_its_tuned_plan_bitwise(tmp_path):
    plain, trainer, offload, spill = _both_trained(tmp_path)
    assert offload.plan is not None and offload.plan.offload  # tuned, and it moves tensors
    stats = offload.stats
    assert stats.steps == STEPS * ACCUMULATE  # one block a micro-batch
    assert stats.offloaded_tensors == stats.steps * len(offload.plan.offload)  # followed
    assert stats.diverged_steps == 0
    for a, b in zip(plain.model.parameters(), trainer.model.parameters(), strict=True):
        assert same_bits(a, b)
    offload.close()
    assert spill_files(str(spill)) == [] and hooks_are_gone()


def _unmasked():
    """Rows of tokens alone, no attention mask: the model looks for packed sequences in its
    position ids."""
    return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in _data()]


def test_rows_without_a_mask_follow_their_plan_bitwise(tmp_path):
    """Note [Packed sequences are found from the positions' values]: without a mask or a cache
    the model searches its position ids for packed sequences; traced, it finds none, as the real
    step does, and builds no mask."""
    plain, trainer, offload, _ = _both_trained(tmp_path, _unmasked, model=_llama)
    assert offload.plan is not None and offload.plan.offload
    assert offload.stats.diverged_steps == 0
    for a, b in zip(plain.model.parameters(), trainer.model.parameters(), strict=True):
        assert same_bits(a, b)
    offload.close()


def test_batches_padded_to_their_longest_row_each_follow_their_shapes_plan(tmp_path, monkeypatch):
    """Batches padded to their own longest row (two lengths): each length is tuned once, before
    its first micro-batch, and every micro-batch follows its length's plan, bit for bit with the
    plain Trainer (Note [A plan for each shape of batch])."""
    import lms.orchestration.session as session

    tuned = []
    real = session.tune_step
    monkeypatch.setattr(session, "tune_step", lambda *a, **k: tuned.append(a[1]) or real(*a, **k))
    plain, trainer, offload, spill = _both_trained(tmp_path, _lengths, _padded)
    lengths = [batch["input_ids"].shape[1] for batch in tuned]
    assert sorted(lengths) == [40, 64]  # both lengths came, each tuned once
    assert offload.stats.steps == STEPS * ACCUMULATE and offload.stats.diverged_steps == 0
    for a, b in zip(plain.model.parameters(), trainer.model.parameters(), strict=True):
        assert same_bits(a, b)
    offload.close()
    assert spill_files(str(spill)) == [] and hooks_are_gone()


def test_a_budget_no_plan_fits_is_refused_before_any_weight_changes(tmp_path):
    trainer = _trainer(tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    offload_trainer(trainer, budget="64KiB", cache_dir=str(tmp_path / "plans"))
    with pytest.raises(lms.PlanInfeasibleError, match="needs even with every saved tensor"):
        trainer.train()
    for a, b in zip(before, trainer.model.parameters(), strict=True):
        assert same_bits(a, b)
    assert hooks_are_gone()


def test_a_trainer_is_wrapped_once_and_other_objects_are_refused(tmp_path):
    trainer = _trainer(tmp_path)
    offload_trainer(trainer, budget="1GiB")
    with pytest.raises(ValueError, match="wrap it once"):
        offload_trainer(trainer, budget="1GiB")
    with pytest.raises(TypeError, match="transformers.Trainer"):
        offload_trainer(object(), budget="1GiB")
    # a share of the peak needs the trace that tune=False leaves out: refused at once
    with pytest.raises(ValueError, match=r"tune=False\) traces nothing"):
        offload_trainer(_trainer(tmp_path), budget="60%", tune=False)


def test_an_exception_mid_step_leaves_no_hooks_or_spill_files(tmp_path):
    trainer = _trainer(tmp_path)
    spill = tmp_path / "spill"
    spill.mkdir()
    offload_trainer(
        trainer, budget=_budget(), min_offload_bytes=0, spill_dir=str(spill), tune=False
    )
    compute_loss = trainer.compute_loss
    calls = []

    def failing(*args, **kwargs):  # the second micro-batch fails after its forward
        loss = compute_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("failed mid-step")
        return loss

    trainer.compute_loss = failing
    with pytest.raises(RuntimeError, match="failed mid-step"):
        trainer.train()
    assert spill_files(str(spill)) == [] and hooks_are_gone()
