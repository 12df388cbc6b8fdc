"""Real models with random weights and synthetic batches, for analysis, training and benchmarks.

Nothing is downloaded: torchvision and MONAI build the architectures; weights are initialised
randomly (under fake tensors when tracing, so building costs no memory).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Sequence

import torch
from torch import no_grad
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from lms.analysis.recorder import CpuKernelShapes
from lms.analysis.trace import meta_failures_told_once, primary_output
from lms.analysis.values import Values
from lms.core.extras import require

log = logging.getLogger("lms.harness.zoo")

__all__ = ["BatchRejectedError", "ZooModel", "ZOO", "zoo_model", "on_meta", "TinyLM"]


class BatchRejectedError(ValueError):
    """The model itself rejects a batch of the asked size: its own error is in the message (a
    ViT built for 224 px given 448, a U-Net given fewer voxels than it pools), and in
    ``reason``."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason
        """The model's own error, as ``"ValueError: ..."``."""


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A model of the zoo: how to build it, make a batch, and count the data it eats."""

    name: str
    build: Callable[[], torch.nn.Module]
    make_batch: Callable[[int, int], Sequence[torch.Tensor]]
    """``make_batch(size, batch_size)``: the input tensors."""
    unit: str
    """What the data rate counts: "pixels", "voxels", "tokens" or "samples" (of a 1D signal)."""
    elements: Callable[[int], int]
    """Elements (pixels, voxels, tokens) of one sample at ``size``."""
    default_size: int
    step_fn: Callable[[torch.nn.Module, Sequence[torch.Tensor]], torch.Tensor] | None = None
    min_batch: int = 1
    """The smallest batch the model trains on; the command line's default batch size."""
    min_batch_reason: str = ""
    smallest_batch_at: Callable[[int], int] | None = None
    """Where the smallest batch depends on the model's code (an imported builder's): that batch
    at a size, found on the meta device; None where `min_batch` holds."""
    classifies_images: bool = False
    """Whether it classifies 3-channel images into 1000 classes, so that a folder of labelled
    images (``lms train --data``) can feed it."""

    needs: tuple[str, ...] = ()
    """Optional packages it is built from (`lms.core.extras`)."""

    def sized(self, size: int) -> str:
        """``size`` in words: ``"8192 tokens"``, ``"320 px"``, else ``"size 64"``."""
        return {"tokens": f"{size} tokens", "pixels": f"{size} px"}.get(self.unit, f"size {size}")

    def check_installed(self) -> None:
        """Refuse, before any work, a model whose packages are missing, naming the extra.

        Raises:
            MissingExtraError: a package in `needs` is not installed.
        """
        for package in self.needs:
            require(package, for_what=f"the zoo model {self.name}")

    def default_batch(self, size: int) -> int:
        """The command line's default batch size at ``size``: the smallest the model trains on."""
        return self.min_batch if self.smallest_batch_at is None else self.smallest_batch_at(size)

    def first_size_taken(self, size: int, batch_size: int | None = None) -> int:
        """``size``, where the model takes a batch of it; else the first larger size it takes,
        in steps of 32 pixels or 16 voxels up to twice ``size`` (Note [A default size the model
        rejects]). ``batch_size``: None for each size's default batch.

        Raises:
            BatchRejectedError: the model takes none of them (the message is ``size``'s).
        """
        step = {"pixels": 32, "voxels": 16}.get(self.unit)
        try:
            self.make_batch(size, batch_size or self.default_batch(size))
            return size
        except BatchRejectedError as rejected:
            if step is None:
                raise
            for larger in range((size // step + 1) * step, 2 * size + 1, step):
                try:
                    self.make_batch(larger, batch_size or self.default_batch(larger))
                except BatchRejectedError:
                    continue
                log.info(
                    "[LMS] %s rejects its default, %s (%s); taking %s, the first larger size "
                    "it takes (--image-size sets another)",
                    self.name,
                    self.sized(size),
                    rejected.reason,
                    self.sized(larger),
                )
                return larger
            raise

    def check_batch(self, batch_size: int) -> None:
        """Refuse a batch the model cannot train on, before anything is built.

        Raises:
            ValueError: ``batch_size`` is below `min_batch` (the message says why).
        """
        if batch_size < self.min_batch:
            why = f" ({self.min_batch_reason})" if self.min_batch_reason else ""
            raise ValueError(
                f"lms: {self.name} trains on batches of {self.min_batch} or more{why}; got batch "
                f"size {batch_size}"
            )


def _resnet50() -> torch.nn.Module:
    from torchvision.models import resnet50

    return resnet50(weights=None)


def _googlenet() -> torch.nn.Module:
    from torchvision.models import googlenet

    return googlenet(weights=None, aux_logits=False, init_weights=False)


def _deeplabv3() -> torch.nn.Module:
    from torchvision.models.segmentation import deeplabv3_resnet50

    return deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=21, aux_loss=False)


def _unet3d() -> torch.nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2)


class TinyLM(torch.nn.Module):
    """A decoder-only transformer language model (pre-norm, causal attention)."""

    def __init__(self, vocab: int = 32000, dim: int = 1024, layers: int = 12, heads: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                dim,
                heads,
                4 * dim,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
                activation="gelu",
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()``, with autocast's cache emptied first.

    Note: [The zoo's steps let go of autocast's casts]
    With ``--amp`` a command runs each step, backward included, under autocast, which keeps its
    casts of the weights until its block ends (Note [Autocast keeps its casts of the weights] in
    `lms/report/text.py`): every weight's bfloat16 copy would stay through backward, held by the
    cache where only autograd needs it, and no plan could move it. The step's own code empties
    the cache once the loss is known, so autograd alone holds them, as where backward runs after
    the autocast block. Backward does not read the cache: its ops run in the dtypes forward used.
    """
    torch.clear_autocast_cache()
    loss.backward()


def _lm_step(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    logits = primary_output(model(tokens))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    _backward(loss)
    return loss


def _classify_step(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    out = primary_output(model(inputs))
    if targets.is_floating_point():  # one output channel: a regression
        loss = torch.nn.functional.mse_loss(out.float(), targets)
    else:
        loss = torch.nn.functional.cross_entropy(out.float(), targets)
    _backward(loss)
    return loss


def _token_step(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """`_classify_step` for a model of tokens, whose output may have a class a token on its
    last dim (a language model's logits)."""
    targets = batch[1]
    per_sample = targets.is_floating_point() or targets.dim() < 2
    return (_classify_step if per_sample else _lm_step)(model, batch)


# Note: [An encoder-decoder model learns from its labels]
# A Hugging Face encoder-decoder model (T5, BART) runs its decoder on tokens of its own, which it
# makes from the labels it is given (shifted right), as its users train it; given the inputs alone
# it has none and raises. Its batch is then the inputs and a target token a position, of the
# decoder's vocabulary, and its step is its own loss over them. A model of speech (Whisper)
# encodes frames of a spectrogram, whose count says nothing of how many tokens its decoder
# writes: its labels are as many tokens as its decoder's positions allow, at most that count.
def _labelled_step(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """An encoder-decoder model's step: its own loss, given the targets as its labels (Note [An
    encoder-decoder model learns from its labels])."""
    inputs, targets = batch
    loss = model(inputs, labels=targets).loss
    _backward(loss)
    return loss


def _images(channels: int, classes: int) -> Callable[[int, int], Sequence[torch.Tensor]]:
    def make(size: int, batch: int) -> Sequence[torch.Tensor]:
        return [torch.randn(batch, channels, size, size), torch.randint(0, classes, (batch,))]

    return make


def _segmentation(size: int, batch: int) -> Sequence[torch.Tensor]:
    return [torch.randn(batch, 3, size, size), torch.randint(0, 21, (batch, size, size))]


def _volumes(size: int, batch: int) -> Sequence[torch.Tensor]:
    return [torch.randn(batch, 1, size, size, size), torch.randint(0, 2, (batch, size, size, size))]


def _gpt2() -> torch.nn.Module:
    """GPT-2 medium's shape (24 layers, hidden 1024, 16 heads), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=8192))


def _llama() -> torch.nn.Module:
    """A Llama-3.2-1B-shaped model (16 layers, hidden 2048, 32 heads with 8 KV heads,
    intermediate 8192, rotary embeddings, tied embeddings), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _hf_tokens(vocab: int) -> Callable[[int, int], Sequence[torch.Tensor]]:
    def make(size: int, batch: int) -> Sequence[torch.Tensor]:
        return [torch.randint(0, vocab, (batch, size))]

    return make


def _hf_lm_step(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """A Hugging Face causal LM's step: its own loss over the batch's next tokens."""
    loss = model(input_ids=batch[0], labels=batch[0]).loss
    _backward(loss)
    return loss


def _tokens(size: int, batch: int) -> Sequence[torch.Tensor]:
    return [torch.randint(0, 32000, (batch, size)), torch.randint(0, 32000, (batch, size))]


def _classifier(
    name: str, build: Callable[[], torch.nn.Module], *, needs: tuple[str, ...] = ()
) -> ZooModel:
    """An image classifier: 3 channels in, 1000 classes out, trained at 224 px by default."""
    return ZooModel(
        name,
        build,
        _images(3, 1000),
        "pixels",
        lambda s: s * s,
        224,
        _classify_step,
        classifies_images=True,
        needs=needs,
    )


ZOO: dict[str, ZooModel] = {
    model.name: model
    for model in (
        _classifier("resnet50", _resnet50, needs=("torchvision",)),
        _classifier("googlenet", _googlenet, needs=("torchvision",)),
        ZooModel(
            "deeplabv3",
            _deeplabv3,
            _segmentation,
            "pixels",
            lambda s: s * s,
            512,
            _classify_step,
            min_batch=2,
            min_batch_reason="the BatchNorm after its image pooling sees one value per channel "
            "in a sample, and training mode needs more than one",
            needs=("torchvision",),
        ),
        ZooModel(
            "unet3d",
            _unet3d,
            _volumes,
            "voxels",
            lambda s: s**3,
            96,
            _classify_step,
            needs=("monai",),
        ),
        ZooModel("tinylm", TinyLM, _tokens, "tokens", lambda s: s, 2048, _lm_step),
        ZooModel(
            "gpt2",
            _gpt2,
            _hf_tokens(50257),
            "tokens",
            lambda s: s,
            1024,
            _hf_lm_step,
            needs=("transformers",),
        ),
        ZooModel(
            "llama",
            _llama,
            _hf_tokens(128256),
            "tokens",
            lambda s: s,
            8192,
            _hf_lm_step,
            needs=("transformers",),
        ),
    )
}


def zoo_model(name: str) -> ZooModel:
    """Look a model up by name, take a name torchvision lists (``"efficientnet_b0"``), or
    import one given as ``"package.module:builder"``.

    A torchvision model is built by `torchvision.models.get_model` with random weights; an
    imported builder is called with no arguments, such as ``"torchvision.models:vit_b_16"`` or
    ``"monai.networks.nets:SegResNet"``. The batch of either is made from its first convolution
    and its output (`_imported`).

    Raises:
        ValueError: for an unknown name (listing the known ones) or a builder that cannot be
            imported.
    """
    if name in ZOO:
        ZOO[name].check_installed()
        return ZOO[name]
    if ":" not in name:
        if name in _torchvision_models():
            return _torchvision_entry(name)
        raise ValueError(
            f"lms: model={name!r} is not in the zoo; known: {', '.join(ZOO)}, a torchvision "
            "model's name (torchvision.models.list_models(), with the zoo extra), or "
            "'package.module:builder' for a model of your own"
        )
    module_name, _, attribute = name.partition(":")
    try:
        build = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"lms: model={name!r} cannot be imported: {error}") from None
    if not callable(build):
        raise ValueError(f"lms: model={name!r} is not callable")
    needed = _required_arguments(build)
    if needed:
        given = ", ".join(f"{argument}=..." for argument in needed)
        raise ValueError(
            f"lms: model={name!r} needs arguments to build ({', '.join(needed)}), and a builder "
            "is called with none: write one that gives them, in a module of yours "
            f"(mymodels.py: def model(): return {attribute}({given})) and pass --model "
            "mymodels:model from its folder"
        )
    return _imported(name, build)


def _required_arguments(build: Callable[..., object]) -> list[str]:
    """The parameters ``build`` cannot be called without (a class's, for its constructor);
    none where its signature cannot be read."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):  # a builtin without one
        return []
    gathered = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        parameter.name
        for parameter in signature.parameters.values()
        if parameter.default is inspect.Parameter.empty and parameter.kind not in gathered
    ]


def _torchvision_models() -> list[str]:
    """The names torchvision's model registry lists, none where it is not installed."""
    if importlib.util.find_spec("torchvision") is None:
        return []
    import torchvision

    return list(torchvision.models.list_models())


VIDEO_FRAMES = 16
"""Frames of a clip a torchvision video model is fed: the length its recipe trains on (MViT
takes no other)."""


def _torchvision_entry(name: str) -> ZooModel:
    """A torchvision model, fed as an imported builder is; a video model clips of
    `VIDEO_FRAMES` frames of ``size`` pixels square.

    Raises:
        ValueError: a detection or optical flow model, whose training batch (images with their
            boxes, pairs of frames) the zoo does not make.
    """
    import torchvision.models

    batches = {"detection": "images with their boxes", "optical_flow": "pairs of frames"}
    for family, batch in batches.items():
        if name in torchvision.models.list_models(module=getattr(torchvision.models, family)):
            raise ValueError(
                f"lms: model={name!r} trains on {batch}, which the zoo does not make; train it "
                "with lms.LMS(budget=...) around your own step"
            )
    video = name in torchvision.models.list_models(module=torchvision.models.video)
    return _imported(
        name,
        _torchvision_builder(name),
        frames=VIDEO_FRAMES if video else None,
        default_size=_recipe_size(name),
    )


def _recipe_size(name: str) -> int | None:
    """The smallest edge torchvision's weights of ``name`` crop their images to (Inception v3's
    299 px, where 224 px is too small for its auxiliary classifier); None where none says."""
    import torchvision.models

    try:
        weights = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):  # a model without weights
        return None
    sizes = []
    for entry in weights:
        crop = getattr(entry.transforms, "keywords", {}).get("crop_size")
        if isinstance(crop, int):
            sizes.append(crop)
        elif isinstance(crop, (tuple, list)) and crop:
            sizes.append(int(crop[0]))
    return min(sizes, default=None)


def _torchvision_builder(name: str) -> Callable[[], torch.nn.Module]:
    """Torchvision's builder of ``name`` with random weights throughout: a backbone it would
    otherwise load pretrained (segmentation and detection models) is left random too."""
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    own = inspect.signature(builder).parameters
    return functools.partial(
        builder, **({"weights_backbone": None} if "weights_backbone" in own else {})
    )


def on_meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model ``build`` makes, its tensors on the meta device: built there, or, where its
    code reads a tensor's value (SwinUNETR's drop rates), built for real, then moved. A tensor
    made by a constructor that ignores the default device (``torch.Tensor(n)``: wav2vec 2.0's
    mask embedding) is moved there too."""
    try:
        with torch.device("meta"):
            built = build()
    except Exception:  # the real build says what is wrong, if anything is
        built = build()
    return built.to("meta") if isinstance(built, torch.nn.Module) else built


_INPUTS: dict[type[torch.nn.Module], int] = {
    torch.nn.Embedding: 0,
    torch.nn.Conv1d: 1,
    torch.nn.Conv2d: 2,
    torch.nn.Conv3d: 3,
}
"""The modules an imported model's input is told from, with its spatial dims (0: tokens)."""
# Note: [A default size the model rejects]
# A builder's model gets its kind's size where nothing says another (`_DEFAULT_SIZES`), and some
# take only sizes their pooling or their fixed shapes allow: MONAI's AHNet pools 96 voxels to
# nothing and takes 128, HoVerNet asks for 256 px. Where the user gave no size, `lms analyze`
# and `lms train` then take the first larger size the model takes, probed on fake tensors a
# step at a time (32 pixels, 16 voxels) up to twice the default, and say so; a size the user
# gave is taken or refused as it is, and a model that takes none of them is refused at its
# default, with its own error.
_DEFAULT_SIZES = {0: 512, 1: 16000, 2: 224, 3: 96}
_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"
"""What PyTorch's batch norm raises in training mode on one value a channel."""


def _configured_size(config: object, dims: int) -> int | None:
    """The size a Hugging Face model's ``config`` sets for its input, where it sets one: the
    images of a vision model (``image_size``, square), or the most tokens of a language model
    (``max_position_embeddings``, ``n_positions``) where fewer than its kind's default; None
    where it sets none, so the kind's default holds."""
    if config is None:
        return None
    if dims in (2, 3):
        size = getattr(config, "image_size", None)
        if isinstance(size, (tuple, list)) and size and len(set(size)) == 1:
            size = size[0]
        return size if isinstance(size, int) and size > 0 else None
    if dims == 0:
        for key in ("max_position_embeddings", "n_positions"):
            positions = getattr(config, key, None)
            if isinstance(positions, int) and 0 < positions < _DEFAULT_SIZES[0]:
                return positions
    return None


def _imported(
    name: str,
    build: Callable[[], torch.nn.Module],
    *,
    frames: int | None = None,
    default_size: int | None = None,
) -> ZooModel:
    """A model from a builder of the user's, fed what its first input module takes: a
    convolution's batch of 1D signals, images or volumes of its channels (``size`` along each
    spatial dim; with ``frames``, clips of that many frames ``size`` pixels square), or an
    embedding's batch of ``size`` tokens of its vocabulary. Its targets are classes of its
    output's channels, per sample, pixel or token as the output has them (a token's last: a
    language model's logits), or with one channel a regression on zeros. The builder runs on
    the meta device to find them (`on_meta`), so this mostly costs no memory. Its size when none
    is given is ``default_size``, else what its Hugging Face config sets (`_configured_size`),
    else its kind's (`_DEFAULT_SIZES`).

    Raises:
        ValueError: the builder fails, the model has neither a convolution nor an embedding
            to take its input from, or its forward needs more than one input; from
            ``make_batch``, the model fails on the batch's shape.
    """
    try:
        probe = on_meta(build)
    except Exception as error:  # the user's code: whatever it raises is reported as theirs
        raise ValueError(
            f"lms: model={name!r} failed to build: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(probe, torch.nn.Module):
        raise ValueError(f"lms: model={name!r} built a {type(probe).__name__}, not a module")
    first = next((m for m in probe.modules() if isinstance(m, tuple(_INPUTS))), None)
    if first is None:
        raise ValueError(
            f"lms: model={name!r} has neither a convolution nor an embedding, so its input "
            "cannot be told from it; train it with lms.LMS around your own step, or plan it with "
            "lms.analyze and your own batch"
        )
    inputs = _required_arguments(probe.forward)
    if len(inputs) > 1:
        raise ValueError(
            f"lms: model={name!r} takes {len(inputs)} inputs ({', '.join(inputs)}), and a "
            "builder's model is fed one batch; train it with lms.LMS around your own step, or "
            "write a builder whose model takes one input and makes the others"
        )
    dims = next(dims for kind, dims in _INPUTS.items() if isinstance(first, kind))
    # Note [An encoder-decoder model learns from its labels]
    config = getattr(probe, "config", None)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    positions = getattr(config, "max_target_positions", None) or getattr(
        config, "max_position_embeddings", None
    )

    def decoded_length(size: int) -> int:
        """How many tokens an encoder-decoder model's labels hold, at ``size``."""
        return min(size, positions) if dims and isinstance(positions, int) else size

    # Note: [A waveform without its channel]
    # A model of raw audio (wav2vec 2.0, HuBERT) takes a batch of waveforms, [batch, samples],
    # and adds the one channel of its first convolution itself: a batch with that channel
    # already there fails in the convolution. Where a one-channel 1D convolution comes first
    # and the batch with the channel fails, the batch without it is tried, and kept if it runs.
    waveform = [False]  # whether the batch drops that channel, once a probe has found it must
    # Note: [The convolution that runs first]
    # The first convolution a model defines is mostly the first it runs, but not always: MONAI's
    # DiNTS defines its search space's cells, of 32 channels, before the stem that takes its one.
    # Where the batch of the first one's channels fails, the channels of the model's other
    # convolutions of that kind are tried in the order it defines them, and the first that runs
    # is kept. Each is probed on a batch's shape alone, on the meta device, and only the batch
    # that runs is filled: a real batch of each channel count tried in vain took MONAI's AHNet
    # 185 s of random numbers (benchmarks/results/README.md, "Probes on shapes alone").
    channels = [getattr(first, "in_channels", 0)]
    others = list(
        dict.fromkeys(
            m.in_channels
            for m in probe.modules()
            if type(m) is type(first) and getattr(m, "in_channels", channels[0]) != channels[0]
        )
    )

    def inputs_of(size: int, batch: int, device: str = "cpu") -> torch.Tensor:
        """The batch's inputs at ``size``: on ``"meta"``, their shape alone, to probe with (a
        real batch of a channel count tried in vain can take seconds to fill)."""
        if isinstance(first, torch.nn.Embedding):
            return torch.randint(0, first.num_embeddings, (batch, size), device=device)
        if frames is not None:
            return torch.randn(batch, channels[0], frames, size, size, device=device)
        if waveform[0]:
            return torch.randn(batch, size, device=device)
        return torch.randn(batch, channels[0], *[size] * dims, device=device)

    def may_be_waveform() -> bool:
        return isinstance(first, torch.nn.Conv1d) and first.in_channels == 1 and not waveform[0]

    shapes: dict[tuple[tuple[int, ...], int], torch.Size] = {}  # `shape_of`'s answers

    def shape_of(inputs: torch.Tensor, size: int) -> torch.Size:
        """The model's primary output's shape on a batch shaped as ``inputs``, made at ``size``
        (each shape probed once: the default batch's probe is also the batch's); raises what
        the model raises."""
        key = (tuple(inputs.shape), size)
        if key not in shapes:
            shapes[key] = _probed_shape(inputs, size)
        return shapes[key]

    def _probed_shape(inputs: torch.Tensor, size: int) -> torch.Size:
        # fake tensors over the meta device: a model's code that asks whether it is traced
        # (Hugging Face's masks) then reads no value, which meta tensors lack. The batch may be
        # made inside a trace, whose default device would move a tensor the model passes
        # through a factory (MONAI's HighResNet: `torch.as_tensor`) off meta
        with (
            _disable_current_modes(),
            torch.device("meta"),
            FakeTensorMode(allow_non_fake_inputs=True),
            no_grad(),
            meta_failures_told_once(),
            CpuKernelShapes(Values()),
        ):
            meta = torch.empty_like(inputs, device="meta")
            decoded = torch.zeros(
                len(inputs), decoded_length(size), dtype=torch.long, device="meta"
            )
            return primary_output(
                probe(meta, decoder_input_ids=decoded) if seq2seq else probe(meta)
            ).shape

    def smallest_batch(size: int) -> int:
        # Note: [A sample of one value per channel]
        # A BatchNorm after pooling to one pixel (an auxiliary classifier's, a segmentation
        # head's image pooling) sees one value per channel in a sample, and training mode
        # refuses to normalize a single value: such a model trains on batches of two or more.
        # Any other failure is left to `make`, which reports it as the model's.
        try:
            shape_of(inputs_of(size, 1, "meta"), size)
        except Exception as error:  # the user's model
            if _ONE_VALUE_PER_CHANNEL in str(error):
                log.info(
                    "[LMS] %s trains on batches of 2 or more (a BatchNorm sees one value per "
                    "channel in a sample): batch size 2",
                    name,
                )
                return 2
        return 1

    def make(size: int, batch: int) -> Sequence[torch.Tensor]:
        inputs = inputs_of(size, batch, "meta")
        try:
            shape = shape_of(inputs, size)
        except Exception as error:  # the user's model: whatever it raises is reported as theirs
            if may_be_waveform():
                try:
                    shape = shape_of(inputs[:, 0], size)
                except Exception:  # not a waveform either: the first failure is the model's
                    pass
                else:
                    waveform[0] = True
                    return _targets(inputs_of(size, batch), shape)
            taken = channels[0]
            for other in others:  # Note [The convolution that runs first]
                channels[0] = other
                try:
                    shape = shape_of(inputs_of(size, batch, "meta"), size)
                except Exception:  # nor these channels
                    continue
                log.info(
                    "[LMS] %s takes %d channels in (the first convolution it defines takes %d, "
                    "but does not run first)",
                    name,
                    other,
                    taken,
                )
                others.clear()  # found: the batch keeps its channels from now on
                return _targets(inputs_of(size, batch), shape)
            channels[0] = taken
            reason = f"{type(error).__name__}: {error}"
            raise BatchRejectedError(
                f"lms: model={name!r} fails on a batch of shape {list(inputs.shape)}: "
                f"{reason}; try another size or batch size",
                reason,
            ) from None
        return _targets(inputs_of(size, batch), shape)

    def _targets(inputs: torch.Tensor, shape: torch.Size) -> Sequence[torch.Tensor]:
        batch = len(inputs)
        if (dims == 0 or seq2seq) and len(shape) == 3:  # a class a token, on the last dim
            classes, per = shape[2], (batch, shape[1])
        else:
            classes, per = (shape[1] if len(shape) > 1 else 1), (batch, *shape[2:])
        if classes < 2:
            return [inputs, torch.zeros(shape)]
        return [inputs, torch.randint(0, classes, per)]

    return ZooModel(
        name,
        build,
        make,
        ("tokens", "samples", "pixels", "voxels")[dims],
        (lambda s: frames * s * s) if frames is not None else (lambda s: s ** max(dims, 1)),
        default_size or _configured_size(config, dims) or _DEFAULT_SIZES[dims],
        _labelled_step if seq2seq else _token_step if dims == 0 else _classify_step,
        classifies_images=dims == 2 and getattr(first, "in_channels", 0) == 3,
        smallest_batch_at=smallest_batch,
    )
