"""Bitwise check on Hugging Face models outside the zoo: BERT, T5, Qwen2, Mistral, GPT-NeoX and
ViT, tiny configs (hidden 256, three layers; sequence 512, or 224 px); then BART, Whisper, CLIP,
Mamba, ModernBERT, Qwen3, ELECTRA, Swin and SegFormer, tinier (hidden 128, two layers; sequence
256 or 512, 224 or 256 px, Whisper's 3000 frames of 80 mel bins); then twelve more families as
tiny (`_further_cases`: wav2vec 2.0 with its time masks, DeBERTa-v2, Longformer, ALBERT, BLOOM,
GPT-J, OPT, Gemma, XLNet, Funnel, DINOv2, ConvNeXt); then two mixtures of experts (`_moe_cases`:
Mixtral, Qwen2-MoE) and eight later decoders (`_decoder_cases`: Gemma 2, Phi-3, StableLM,
StarCoder2, GPT-BigCode, OLMo, Cohere, Falcon); random weights, on the CPU's disk tier.
Each is tuned (`LMS.tune`) at a budget 30% of the way from the least any plan needs to its
peak without offload and runs three steps against three plain ones, PyTorch's deterministic
algorithms on, each step after seeding PyTorch's, Python's and numpy's generators alike; it
passes when every loss and gradient holds the same bits. The language models take a batch as a
tokenizer gives it (an attention mask of ones, and labels) through the default step; each run
also counts the steps that left their plan (``diverged_steps``).

With ``--plans recompute`` each follows a plan that recomputes every storage it can (where
neither its inputs nor what reads it are recomputed) and offloads the rest, in place of a
tuned one.

    .venv/bin/python benchmarks/hf_bitwise.py [--models a,b] [--plans recompute] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import numpy
import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForMaskedLM,
    BloomConfig,
    BloomForCausalLM,
    CLIPConfig,
    CLIPModel,
    CohereConfig,
    CohereForCausalLM,
    ConvNextConfig,
    ConvNextForImageClassification,
    DebertaV2Config,
    DebertaV2ForMaskedLM,
    Dinov2Config,
    Dinov2ForImageClassification,
    ElectraConfig,
    ElectraForMaskedLM,
    FalconConfig,
    FalconForCausalLM,
    FunnelConfig,
    FunnelForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LongformerConfig,
    LongformerForMaskedLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    ModernBertConfig,
    ModernBertForMaskedLM,
    OlmoConfig,
    OlmoForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SegformerConfig,
    SegformerForSemanticSegmentation,
    StableLmConfig,
    StableLmForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
    SwinConfig,
    SwinForImageClassification,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
    Wav2Vec2Config,
    Wav2Vec2ForCTC,
    WhisperConfig,
    WhisperForConditionalGeneration,
    XLNetConfig,
    XLNetLMHeadModel,
)

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.analysis.trace import default_step
from lms.core.recipes import recipes
from lms.orchestration.local import local_device_spec
from lms.planning.candidates import Candidates

SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 3}
LM = {**SHAPE, "vocab_size": 500, "num_attention_heads": 4}


def _seq2seq(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=batch[0], labels=batch[1])
    out.loss.backward()
    return out.loss


def _image(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(pixel_values=batch[0], labels=batch[1])
    out.loss.backward()
    return out.loss


def _speech(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(input_features=batch[0], labels=batch[1])
    out.loss.backward()
    return out.loss


def _ctc(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(input_values=batch[0], labels=batch[1])
    out.loss.backward()
    return out.loss


def _contrastive(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=batch[0], pixel_values=batch[1], return_loss=True)
    out.loss.backward()
    return out.loss


SMALL = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2}
SMALL_LM = {**SMALL, "vocab_size": 500, "num_attention_heads": 4}
ENCODER_DECODER = {
    "vocab_size": 500, "d_model": 128, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 256,
    "decoder_ffn_dim": 256,
}  # fmt: skip


def _more_cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    """Encoder-decoders (one of speech), two towers, a state-space model, local and global
    attention, and hierarchical vision models, tinier than `_cases`."""
    ids = torch.randint(0, 500, (2, 256))
    tokens = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    pairs = {**tokens, "labels": ids[:, :128].clone()}
    towers = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    clip = CLIPConfig(
        text_config={**towers, "num_attention_heads": 4, "vocab_size": 500},
        vision_config={**towers, "num_attention_heads": 4, "image_size": 224, "patch_size": 16},
    )
    whisper = WhisperConfig(
        **ENCODER_DECODER, num_mel_bins=80, decoder_start_token_id=1, pad_token_id=0
    )
    swin = SwinConfig(embed_dim=48, depths=[2, 2, 2, 2], num_heads=[2, 4, 8, 16], num_labels=10)
    segformer = SegformerConfig(
        num_labels=5, hidden_sizes=[32, 64, 160, 256], depths=[1, 1, 1, 1], decoder_hidden_size=128
    )
    modern = ModernBertConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, vocab_size=500,
        num_attention_heads=4, pad_token_id=0, global_attn_every_n_layers=2, local_attention=64,
    )  # fmt: skip
    return {
        "bart": (
            lambda: BartForConditionalGeneration(BartConfig(**ENCODER_DECODER, dropout=0.1)),
            pairs,
            None,
        ),
        "whisper": (
            lambda: WhisperForConditionalGeneration(whisper),
            [torch.randn(2, 80, 3000), torch.randint(2, 500, (2, 64))],
            _speech,
        ),
        "clip": (
            lambda: CLIPModel(clip),
            [torch.randint(0, 500, (4, 77)), torch.randn(4, 3, 224, 224)],
            _contrastive,
        ),
        "mamba": (
            lambda: MambaForCausalLM(
                MambaConfig(hidden_size=128, num_hidden_layers=2, vocab_size=500, state_size=8)
            ),
            tokens,
            None,
        ),
        "modernbert": (lambda: ModernBertForMaskedLM(modern), tokens, None),
        "qwen3": (
            lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL_LM, num_key_value_heads=2, head_dim=32)),
            tokens,
            None,
        ),
        "electra": (
            lambda: ElectraForMaskedLM(ElectraConfig(**SMALL_LM, embedding_size=64)),
            tokens,
            None,
        ),
        "swin": (
            lambda: SwinForImageClassification(swin),
            [torch.randn(4, 3, 224, 224), torch.randint(0, 10, (4,))],
            _image,
        ),
        "segformer": (
            lambda: SegformerForSemanticSegmentation(segformer),
            [torch.randn(2, 3, 256, 256), torch.randint(0, 5, (2, 256, 256))],
            _image,
        ),
    }


def _further_cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    """Speech with time masks drawn from numpy, disentangled, sliding-window and two-stream
    attention, layers sharing their weights, ALiBi, parallel attention and feed-forward, pooled
    sequences, and convolutional and registered-patch vision models, as tiny as `_more_cases`."""
    ids = torch.randint(0, 500, (2, 256))
    tokens = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    images = [torch.randn(2, 3, 224, 224), torch.randint(0, 10, (2,))]
    small = {**SMALL, "num_attention_heads": 4}
    wav2vec2 = Wav2Vec2Config(
        **small, vocab_size=32, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3), num_feat_extract_layers=3, mask_time_prob=0.2,
        mask_time_length=4, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
    )  # fmt: skip
    deberta = DebertaV2Config(
        **SMALL_LM, relative_attention=True, pos_att_type=["p2c", "c2p"],
        max_relative_positions=64,
    )  # fmt: skip
    longformer = LongformerConfig(
        **SMALL_LM, attention_window=64, max_position_embeddings=600, pad_token_id=1
    )
    decoder = {"vocab_size": 500, "n_layer": 2, "n_head": 4}
    opt = OPTConfig(
        hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=500, dropout=0.1,
    )  # fmt: skip
    funnel = FunnelConfig(
        vocab_size=500, block_sizes=[1, 1], d_model=128, n_head=4, d_head=32, d_inner=256
    )
    xlnet = XLNetConfig(d_model=128, n_layer=2, n_head=4, d_inner=256, vocab_size=500)
    convnext = ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_labels=10)
    return {
        "wav2vec2": (
            lambda: Wav2Vec2ForCTC(wav2vec2),
            [torch.randn(2, 16000), torch.randint(1, 32, (2, 40))],
            _ctc,
        ),
        "deberta_v2": (lambda: DebertaV2ForMaskedLM(deberta), tokens, None),
        "longformer": (lambda: LongformerForMaskedLM(longformer), tokens, None),
        "albert": (
            lambda: AlbertForMaskedLM(AlbertConfig(**SMALL_LM, embedding_size=64)),
            tokens,
            None,
        ),
        "bloom": (lambda: BloomForCausalLM(BloomConfig(hidden_size=128, **decoder)), tokens, None),
        "gptj": (
            lambda: GPTJForCausalLM(
                GPTJConfig(n_embd=128, rotary_dim=16, n_positions=512, **decoder)
            ),
            tokens,
            None,
        ),
        "opt": (lambda: OPTForCausalLM(opt), tokens, None),
        "gemma": (
            lambda: GemmaForCausalLM(GemmaConfig(**SMALL_LM, num_key_value_heads=1, head_dim=32)),
            tokens,
            None,
        ),
        "xlnet": (lambda: XLNetLMHeadModel(xlnet), {"input_ids": ids, "labels": ids}, None),
        "funnel": (lambda: FunnelForMaskedLM(funnel), tokens, None),
        "dinov2": (
            lambda: Dinov2ForImageClassification(
                Dinov2Config(**small, image_size=224, patch_size=14, num_labels=10)
            ),
            images,
            _image,
        ),
        "convnext": (lambda: ConvNextForImageClassification(convnext), images, _image),
    }


def _moe_cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    """Mixtures of experts, each token routed to two of four experts by its router's top-k: the
    experts each run on the tokens routed to them, indices that depend on the data."""
    ids = torch.randint(0, 500, (2, 256))
    tokens = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    experts = {"num_key_value_heads": 2, "num_experts_per_tok": 2}
    mixtral = MixtralConfig(**SMALL_LM, **experts, num_local_experts=4)
    qwen2_moe = Qwen2MoeConfig(
        **SMALL_LM, **experts, num_experts=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
    )  # fmt: skip
    return {
        "mixtral": (lambda: MixtralForCausalLM(mixtral), tokens, None),
        "qwen2_moe": (lambda: Qwen2MoeForCausalLM(qwen2_moe), tokens, None),
    }


def _decoder_cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    """Decoders of later families, as tiny as `_more_cases`: soft-capped logits and alternating
    sliding windows (Gemma 2), fused projections (Phi-3), partial rotary embeddings (StableLM),
    biases and sliding windows (StarCoder2), multi-query attention (GPT-BigCode), norms without
    weights (OLMo), parallel attention and feed-forward with a logit scale (Cohere), and
    Falcon's."""
    ids = torch.randint(0, 500, (2, 256))
    tokens = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    grouped = {**SMALL_LM, "num_key_value_heads": 2}
    gemma2 = Gemma2Config(**grouped, head_dim=32, sliding_window=64)
    bigcode = GPTBigCodeConfig(n_embd=128, n_layer=2, n_head=4, vocab_size=500, multi_query=True)
    falcon = FalconConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=500
    )
    return {
        "gemma2": (lambda: Gemma2ForCausalLM(gemma2), tokens, None),
        "phi3": (lambda: Phi3ForCausalLM(Phi3Config(**grouped, pad_token_id=0)), tokens, None),
        "stablelm": (lambda: StableLmForCausalLM(StableLmConfig(**grouped)), tokens, None),
        "starcoder2": (lambda: Starcoder2ForCausalLM(Starcoder2Config(**grouped)), tokens, None),
        "gpt_bigcode": (lambda: GPTBigCodeForCausalLM(bigcode), tokens, None),
        "olmo": (lambda: OlmoForCausalLM(OlmoConfig(**SMALL_LM, pad_token_id=0)), tokens, None),
        "cohere": (lambda: CohereForCausalLM(CohereConfig(**grouped)), tokens, None),
        "falcon": (lambda: FalconForCausalLM(falcon), tokens, None),
    }


def _all_cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    return _cases() | _more_cases() | _further_cases() | _moe_cases() | _decoder_cases()


def _seed(seed: int) -> None:
    """PyTorch's, Python's and numpy's generators, alike in both runs (wav2vec 2.0 draws its
    time masks from numpy's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def _cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    ids = torch.randint(0, 500, (4, 512))
    # as a tokenizer gives it, with labels, through the default step (the model's own loss)
    tokens = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    t5 = T5Config(
        vocab_size=500, d_model=256, d_kv=64, d_ff=1024, num_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    vit = ViTConfig(**SHAPE, num_attention_heads=4, image_size=224, patch_size=16, num_labels=10)
    return {
        "bert": (lambda: BertForMaskedLM(BertConfig(**LM)), tokens, None),
        "t5": (
            lambda: T5ForConditionalGeneration(t5),
            [ids, torch.randint(0, 500, (4, 256))],
            _seq2seq,
        ),
        "qwen2": (
            lambda: Qwen2ForCausalLM(Qwen2Config(**LM, num_key_value_heads=2)),
            tokens,
            None,
        ),
        "mistral": (
            lambda: MistralForCausalLM(
                MistralConfig(**LM, num_key_value_heads=2, sliding_window=128)
            ),
            tokens,
            None,
        ),
        "gpt_neox": (lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**LM)), tokens, None),
        "vit": (
            lambda: ViTForImageClassification(vit),
            [torch.randn(8, 3, 224, 224), torch.randint(0, 10, (8,))],
            _image,
        ),
    }


def _recompute_plan(trace: lms.Trace) -> lms.Plan:
    """Every storage with a recipe recomputed where neither its inputs nor what reads it are,
    the rest offloaded: replays of each kind the model's ops allow, whatever a budget picks."""
    found = recipes(trace)
    chosen: set[int] = set()
    for ordinal, recipe in sorted(found.items()):
        if not set(recipe.inputs) & chosen and not any(ordinal in found[c].inputs for c in chosen):
            chosen.add(ordinal)
    candidates = Candidates(trace, device_spec("cpu"), budget_bytes=2**40)
    return candidates.plan(range(candidates.num_entries), source="check", recompute=chosen)


def check(name: str, spill_dir: str, *, plans: str = "tuned") -> dict[str, Any]:
    """Tune ``name`` between its floor and its peak (``plans`` "recompute": follow
    `_recompute_plan` instead); three steps against plain ones."""
    build, batch, given = _all_cases()[name]
    step = given or default_step
    torch.manual_seed(0)
    model = build()
    plain, moved = copy.deepcopy(model), copy.deepcopy(model)
    trace = trace_step(copy.deepcopy(model), batch, step, device="cpu")
    if plans == "recompute":
        offload = lms.LMS(plan=_recompute_plan(trace), tier="disk", spill_dir=spill_dir)
    else:
        peak = simulate(trace, None, local_device_spec(torch.device("cpu"))).peak_bytes
        try:
            lms.LMS(budget=1).tune(copy.deepcopy(model), batch, step)
            floor = peak
        except lms.PlanInfeasibleError as error:
            floor = error.min_budget_bytes
        budget = int(floor + 0.3 * (peak - floor))
        offload = lms.LMS(budget=budget, tier="disk", spill_dir=spill_dir)
        offload.tune(moved, batch, given)
    bitwise = True
    for seed in range(3):
        plain.zero_grad(set_to_none=True)
        moved.zero_grad(set_to_none=True)
        _seed(seed)
        expected = step(plain, batch)
        _seed(seed)
        with offload:
            got = step(moved, batch)
        bitwise = bitwise and torch.equal(expected, got)
        for a, b in zip(plain.parameters(), moved.parameters(), strict=True):
            bitwise = bitwise and (a.grad is None) == (b.grad is None)
            bitwise = bitwise and (a.grad is None or torch.equal(a.grad, b.grad))
    stats = offload.stats
    offload.close()
    return {
        "model": name,
        "plans": plans,
        "bitwise": bitwise and stats.replays_differed == 0,
        "offloaded_per_step": stats.offloaded_tensors // 3,
        "recomputed_per_step": stats.recomputed_tensors // 3,
        "diverged_steps": stats.diverged_steps,
        "saved_entries": offload.plan.num_entries if offload.plan else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(_all_cases()))
    parser.add_argument("--plans", choices=("tuned", "recompute"), default="tuned")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    results = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as spill_dir:
            results.append(check(name, spill_dir, plans=args.plans))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "runs": results}, out, indent=1)
    if not all(r["bitwise"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
