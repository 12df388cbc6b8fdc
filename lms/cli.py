"""The ``lms`` command: analyze, sweep, train and bench zoo models, replay a recorded step, run
the demo.

Logs go to standard error, so that ``--json /dev/stdout`` can be parsed; the exit codes are
`EXIT_CODES`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lms.core.errors import LMSError, PlanInfeasibleError
from lms.core.units import is_share, parse_bytes, parse_share
from lms.core.version import __version__

__all__ = ["EXIT_CODES", "main"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NO_PLAN = 3
EXIT_ALL_RUNS_FAILED = 4
EXIT_CODES = {
    EXIT_OK: "the step fits, or a plan fits; the command did what it was asked",
    EXIT_BAD_INPUT: "bad input (an option, a model, a file), refused before any work",
    EXIT_NO_PLAN: "no plan fits the budget: the step needs more memory even with LMS",
    EXIT_ALL_RUNS_FAILED: "bench: every run failed",
}
"""What the command's exit status says."""

log = logging.getLogger("lms.cli")

_BATCH_HELP = "samples a step (default: the smallest the model trains on, 1 for most)"


def _count(text: str) -> int:
    """A whole number of at least 1 (sizes, batches, steps), or argparse's usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _counts(text: str) -> list[int]:
    """Comma-separated whole numbers of at least 1, such as ``256,512,768``."""
    return [_count(part.strip()) for part in text.split(",")]


def _seconds(text: str) -> float:
    """A number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 seconds")
    return value


_MODEL_HELP = (
    "zoo model (resnet50, googlenet, deeplabv3, unet3d, tinylm, gpt2, llama), a torchvision "
    "model's name (efficientnet_b0, swin_t, r3d_18, ...) or package.module:builder"
)
_AMP_HELP = "bfloat16 autocast"
_SPEC_HELP = (
    "device spec to simulate: a name (see lms.analysis.DEVICES; default v100-32gb) or a JSON "
    "file of a spec's fields, as 'lms analyze --json' writes them under \"spec\""
)
_JSON_HELP = (
    "write the results here as JSON, with the lms and torch versions; its keys are documented "
    "in the command's JSON schema, lms/schemas/COMMAND.schema.json"
)
_NO_SLABS_HELP = (
    "plan the whole step only: never run submodules in slabs, even where nothing else fits "
    "(in slabs, gradients are within float rounding of the whole module's)"
)
_FREE_HELD_HELP = (
    "let the plan empty tensors the step's code holds but no longer reads (the input batch), "
    "filled again in place for backward"
)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help=_MODEL_HELP,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--image-size",
        type=_count,
        metavar="N",
        help="edge in pixels or voxels (default: the model's own, as 224 for an ImageNet "
        "classifier or 96 for a 3D net)",
    )
    size.add_argument(
        "--seq-len",
        type=_count,
        metavar="N",
        help="sequence length, for a model of tokens (tinylm, gpt2, llama, a builder of yours; "
        "default: the model's own, as 512)",
    )
    parser.add_argument("--batch-size", type=_count, default=None, help=_BATCH_HELP)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument(
        "--no-offload-in",
        action="append",
        default=[],
        metavar="MODULE",
        help="keep what this submodule saves on the device (e.g. layer4); repeatable",
    )


def _write_json(path: str, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``path``, with the versions that made it."""
    versions = {"lms_version": __version__, "torch_version": torch.__version__}
    with open(path, "w") as out:
        json.dump({**versions, **result}, out, indent=2)


def _write(args: argparse.Namespace, result: dict[str, Any], plot: Callable[[str], object]) -> None:
    """Write ``--json`` and ``--plot`` where asked."""
    if args.json:
        _write_json(args.json, result)
        log.info("[LMS] wrote %s", args.json)
    if args.plot:
        plot(args.plot)
        log.info("[LMS] wrote %s", args.plot)


def _analyze(args: argparse.Namespace) -> int:
    from lms.core.keep import no_offload_in, submodules
    from lms.harness.zoo import zoo_model
    from lms.orchestration.analyze import analyze

    entry = zoo_model(args.model)
    entry.check_batch(args.batch_size)

    def build() -> torch.nn.Module:
        model = entry.build()
        no_offload_in(*submodules(model, args.no_offload_in))  # this model lives for the trace
        return model

    report = analyze(
        build,
        lambda: entry.make_batch(args.image_size, args.batch_size),
        entry.step_fn,
        gpu_memory=args.gpu_memory,
        device_spec=args.device_spec,
        host_memory=args.host_memory,
        autocast=torch.bfloat16 if args.amp else None,
        name=f"{args.model} {entry.sized(args.image_size)} batch {args.batch_size}",
        free_held=args.free_held,
        slabs=not args.no_slabs,
    )
    _write(args, report.as_dict(), report.plot)
    if args.html:
        report.save_html(args.html)
        log.info("[LMS] wrote %s", args.html)
    if args.snapshot:
        report.save_snapshot(args.snapshot)
        log.info("[LMS] wrote %s (open it at pytorch.org/memory_viz)", args.snapshot)
    return EXIT_OK if report.fits else EXIT_NO_PLAN


def _sweep(args: argparse.Namespace) -> int:
    from lms.harness.sweep import plot_sweep, sweep

    result = sweep(
        args.model,
        gpu_memory=args.gpu_memory,
        step=args.step,
        batch_size=args.batch_size,
        start=args.start,
        device_spec=args.device_spec,
        amp=args.amp,
        max_size=args.max_size,
        free_held=args.free_held,
        slabs=not args.no_slabs,
        progress=not args.quiet,
    )
    _write(args, result, lambda path: plot_sweep(result, path))
    return 0


def _train(args: argparse.Namespace) -> int:
    from lms.harness.train import load_images, train

    data = (
        load_images(args.data, args.model, args.image_size, args.batch_size) if args.data else None
    )
    result = train(  # a budget no plan fits: main's EXIT_NO_PLAN
        args.model,
        size=args.image_size,
        batch_size=args.batch_size,
        steps=args.steps,
        method="lms" if args.lms else "none",
        budget=args.budget,
        tier=args.tier,
        host_budget=args.host_budget,
        amp=args.amp,
        data=data,
        keep_in=args.no_offload_in,
        free_held=args.free_held,
        slabs=not args.no_slabs,
        memory_snapshot=args.memory_snapshot,
        progress=not args.quiet,
        record=args.record,
        cpu_resident=args.cpu_resident,
    )
    if args.json:
        _write_json(args.json, dataclasses.asdict(result))
    return EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    from lms.core.steprecord import load_record
    from lms.report.replay import format_replay, plot_replay, replay

    record = load_record(args.record_file)
    result = replay(record, step=args.step)
    print(format_replay(result))
    _write(
        args,
        {"record": args.record_file, "record_meta": record.meta, **result.as_dict()},
        lambda path: plot_replay(path, record, result),
    )
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from lms.harness.bench import bench, plot_bench

    result = bench(
        args.model,
        sizes=args.sizes,
        budget=args.budget,
        methods=args.methods.split(","),
        batch_size=args.batch_size,
        steps=args.steps,
        amp=args.amp,
        repeats=args.repeats,
        timeout_s=args.run_timeout,
        time_limit_s=args.time_limit,
        on_point=(lambda partial: _write_json(args.json, partial)) if args.json else None,
        progress=not args.quiet,
    )
    for method, size in result["largest_size"].items():
        log.info("[LMS] largest size reached by %s: %s", method, size)
    _write(args, result, lambda path: plot_bench(result, path))
    ran = [point for point in result["points"] if point.get("ok") is not None]
    if ran and not any(point.get("ok") for point in ran):
        log.error("[LMS] every run failed; the first: %s", ran[0].get("error"))
        return EXIT_ALL_RUNS_FAILED
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from lms.harness.demo import run_demo

    run_demo(out_dir=args.out, steps=args.steps, progress=not args.quiet)
    return 0


# Long by design: a declarative list of the command's options, one call each.
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lms`` command."""
    codes = "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        prog="lms",
        description="Large Model Support for PyTorch",
        epilog=f"exit status:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    quiet_help = "only warnings and errors; no progress bars"
    parser.add_argument("-q", "--quiet", action="store_true", help=quiet_help)
    parser.add_argument(
        "--version", action="version", version=f"lms {__version__} (torch {torch.__version__})"
    )
    # -q also after the command's name; absent there, it leaves the one before it as it is
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=quiet_help
    )
    add_command = functools.partial(
        parser.add_subparsers(dest="command", required=True).add_parser, parents=[quiet]
    )

    analyze = add_command("analyze", help="trace a step with fake tensors and simulate")
    _add_model_args(analyze)
    analyze.add_argument(
        "--gpu-memory",
        type=str,
        default=None,
        help="device memory for the step, e.g. 32GiB, or a share of its simulated peak of tensors "
        "without offload, e.g. 60%%, beside the libraries' workspace (default: the spec's memory)",
    )
    analyze.add_argument(
        "--device-spec",
        default="v100-32gb",
        help=_SPEC_HELP + "; 'local': this machine's device, its rates measured",
    )
    analyze.add_argument(
        "--host-memory", default=None, help="host memory for offloaded data, e.g. 64GiB"
    )
    analyze.add_argument("--json", help="write the summary here")
    analyze.add_argument("--plot", help="write the memory graph (PNG) here")
    analyze.add_argument("--snapshot", help="write a memory_viz snapshot (pickle) here")
    analyze.add_argument(
        "--html",
        help="write one self-contained page here: the lines, memory with and without the plan "
        "(zoomable), the copies and the plan's table; it works offline",
    )
    analyze.add_argument("--free-held", action="store_true", help=_FREE_HELD_HELP)
    analyze.add_argument("--no-slabs", action="store_true", help=_NO_SLABS_HELP)
    analyze.set_defaults(run=_analyze)

    sweep = add_command("sweep", help="grow the image edge until the step cannot fit")
    sweep.add_argument("--model", required=True, help=_MODEL_HELP)
    sweep.add_argument("--gpu-memory", required=True, help="e.g. 32GiB")
    sweep.add_argument(
        "--step",
        type=_count,
        default=None,
        help="edge increment (sequence length, for a model of tokens; default: the first)",
    )
    first = sweep.add_mutually_exclusive_group()
    first.add_argument(
        "--start", type=_count, default=None, help="first edge or length (default: --step)"
    )
    first.add_argument(
        "--seq-len",
        type=_count,
        metavar="N",
        default=None,
        help="first sequence length, for a model of tokens (as --start)",
    )
    sweep.add_argument(
        "--max-size",
        type=_count,
        default=None,
        help="last edge or length tried (default: no limit)",
    )
    sweep.add_argument("--batch-size", type=_count, default=None, help=_BATCH_HELP)
    sweep.add_argument("--amp", action="store_true", help=_AMP_HELP)
    sweep.add_argument("--device-spec", default="v100-32gb", help=_SPEC_HELP)
    sweep.add_argument("--json", help=_JSON_HELP)
    sweep.add_argument("--plot", help="write the graph of both limits (PNG) here")
    sweep.add_argument("--free-held", action="store_true", help=_FREE_HELD_HELP)
    sweep.add_argument("--no-slabs", action="store_true", help=_NO_SLABS_HELP)
    sweep.set_defaults(run=_sweep)

    train = add_command("train", help="train a zoo model and measure it")
    _add_model_args(train)
    train.add_argument(
        "--steps",
        type=_count,
        default=5,
        help="on a CPU, from 3 on, the second step's memory is sampled and the later ones timed",
    )
    train.add_argument(
        "--lms",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train under LMS (--no-lms: plain PyTorch, to compare)",
    )
    train.add_argument(
        "--budget",
        default=None,
        help="device memory for the step, e.g. 32GiB, or a share of its simulated peak of tensors "
        "without offload, e.g. 60%%, beside the libraries' workspace",
    )
    train.add_argument(
        "--tier",
        default="auto",
        choices=["auto", "host", "disk"],
        help="where offloaded data goes: host memory from a GPU, else disk (auto)",
    )
    train.add_argument(
        "--host-budget", default=None, help="host memory offloaded data may hold, e.g. 100GiB"
    )
    train.add_argument(
        "--cpu-resident",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU under a budget, glibc maps each allocation of 1 MiB or more on pages of "
        "its own, so that the resident set holds the budget too, its pages faulted in afresh "
        "each step (LMSConfig.cpu_resident); --no-cpu-resident keeps glibc's own setting: "
        "faster steps, the heap in use held to the budget, the resident set over it by what "
        "glibc keeps",
    )
    train.add_argument("--data", default=None, help="folder of images (one subfolder a class)")
    train.add_argument("--json", help=_JSON_HELP)
    train.add_argument("--free-held", action="store_true", help=_FREE_HELD_HELP)
    train.add_argument("--no-slabs", action="store_true", help=_NO_SLABS_HELP)
    train.add_argument(
        "--memory-snapshot",
        metavar="PATH",
        help="write the CUDA allocator's history of the steps here, also when a step fails "
        "(open it at pytorch.org/memory_viz)",
    )
    train.add_argument(
        "--record",
        metavar="FILE",
        help="write a record of every step here (each op, copy and wait, timed; gzipped JSON) "
        "for `lms replay`; with --budget, or with --no-lms",
    )
    train.set_defaults(run=_train)

    again = add_command(
        "replay", help="simulate a recorded step again and set it beside what it measured"
    )
    again.add_argument(
        "record_file", metavar="record", help="a step record (lms train --record FILE)"
    )
    again.add_argument(
        "--step", type=_count, default=None, help="the recorded step (default: the last)"
    )
    again.add_argument("--json", help=_JSON_HELP)
    again.add_argument("--plot", help="write both timelines, measured above replayed, as a PNG")
    again.set_defaults(run=_replay)

    bench = add_command("bench", help="measure LMS beside the peers over sizes")
    bench.add_argument("--model", required=True, help=_MODEL_HELP)
    sizes = bench.add_mutually_exclusive_group(required=True)
    sizes.add_argument(
        "--sizes",
        type=_counts,
        help="comma-separated edges (sequence lengths, for a model of tokens)",
    )
    sizes.add_argument(
        "--seq-len",
        type=_counts,
        metavar="N[,N...]",
        help="comma-separated sequence lengths, for a model of tokens (as --sizes)",
    )
    bench.add_argument("--budget", default=None, help="device memory each run may use, e.g. 32GiB")
    bench.add_argument(
        "--methods",
        default="none,lms,save_on_cpu,checkpoint",
        help="comma-separated, of none, lms, lms_free_held (LMS with --free-held), save_on_cpu, "
        "checkpoint, hf_checkpoint (Hugging Face gradient checkpointing: gpt2, llama, a builder "
        "of a Hugging Face model), hf_offload "
        "(the same, its layers' inputs in host memory), compile_budget",
    )
    bench.add_argument("--batch-size", type=_count, default=None, help=_BATCH_HELP)
    bench.add_argument(
        "--steps", type=_count, default=3, help="a run's steps, sampled and timed as train's"
    )
    bench.add_argument(
        "--repeats", type=_count, default=1, help="runs of each method a size, in rotated order"
    )
    bench.add_argument("--amp", action="store_true", help=_AMP_HELP)
    bench.add_argument(
        "--time-limit", type=_seconds, default=None, help="seconds after which no run starts"
    )
    bench.add_argument(
        "--run-timeout", type=_seconds, default=900, help="seconds before one run is stopped"
    )
    bench.add_argument("--json", help=_JSON_HELP)
    bench.add_argument("--plot", help="write the graph of rate against size (PNG) here")
    bench.set_defaults(run=_bench)

    demo = add_command("demo", help="analyze, then train past the budget with LMS")
    demo.add_argument("--out", default="out/demo", help="folder for the plot and snapshot")
    demo.add_argument("--steps", type=_count, default=3, help="training steps (default 3)")
    demo.set_defaults(run=_demo)
    return parser


_OUTPUTS = ("json", "plot", "snapshot", "memory_snapshot", "record", "html")
"""The options that name a file the command writes."""


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work starts, an output file that cannot be written: its folder is
    missing or not writable, or it names a folder or a file that cannot be written."""
    for option in _OUTPUTS:
        path = getattr(args, option, None)
        if not path or path in ("-", "/dev/stdout", "/dev/stderr"):
            continue
        flag = "--" + option.replace("_", "-")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"lms: {flag} {path!r} is a folder; name a file to write")
        if not os.path.isdir(folder):
            raise ValueError(
                f"lms: {flag} {path!r}: the folder {folder!r} does not exist; create it or "
                "name a file in an existing folder"
            )
        writable = os.access(path, os.W_OK) if os.path.exists(path) else os.access(folder, os.W_OK)
        if not writable:
            raise ValueError(
                f"lms: {flag} {path!r} cannot be written (permission denied); name a file "
                "in a folder you can write"
            )


def _check_extras(args: argparse.Namespace) -> None:
    """Refuse, before any work, what needs an optional package that is not installed."""
    from lms.core.extras import require

    if args.command == "demo":
        require("matplotlib", for_what="lms demo")
        require("torchvision", for_what="lms demo (ResNet50)")
    elif getattr(args, "plot", None):
        require("matplotlib", for_what="--plot")
    if getattr(args, "data", None):
        require("torchvision", for_what="--data")


def _check_memory(command: str, flag: str, value: str | None, *, takes_share: bool) -> None:
    """Check a memory size given on the command line before any work: a share (``"60%"``)
    where ``command`` takes one, else a size; a share given to a command that runs several
    sizes under one memory size is refused naming the commands that take one.

    Raises:
        ValueError: ``value`` is neither, naming ``flag``.
    """
    if value is None or takes_share and parse_share(value, field=flag) is not None:
        return
    if is_share(value):
        raise ValueError(
            f"lms: {flag}={value!r} is a share of one step's peak, and lms {command} runs "
            "several sizes under one device memory: give a size, as '8GiB' (lms train "
            "--budget and lms analyze --gpu-memory take a share)"
        )
    parse_bytes(value, field=flag, positive=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lms`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"  # for the processes it starts (ops timed, bench runs)
    try:
        # sizes checked before the model is looked at: analyze's --gpu-memory and train's
        # --budget also take a share of the step's peak; a sweep's and a bench's are sizes
        _check_memory(
            args.command,
            "--gpu-memory",
            getattr(args, "gpu_memory", None),
            takes_share=args.command == "analyze",
        )
        _check_memory(
            args.command,
            "--budget",
            getattr(args, "budget", None),
            takes_share=args.command == "train",
        )
        if getattr(args, "host_budget", None) is not None:
            parse_bytes(args.host_budget, field="--host-budget", positive=True)
        if getattr(args, "model", None) is not None:
            from lms.harness.zoo import zoo_model

            if ":" in args.model and not {"", os.getcwd()} & set(sys.path):
                # a builder of the user's comes from where the command runs, as with python -m
                sys.path.insert(0, os.getcwd())

            entry = zoo_model(args.model)  # refuses a model whose packages are missing
            if getattr(args, "seq_len", None) is not None:
                if entry.unit != "tokens":
                    raise ValueError(
                        f"lms: --seq-len is the length of a model's sequences of tokens, and "
                        f"{args.model} takes {entry.unit}; give its edge with --image-size"
                    )
                if args.command == "bench":
                    args.sizes = args.seq_len
                elif args.command == "sweep":
                    args.start = args.seq_len
                else:
                    args.image_size = args.seq_len
            defaulted = args.command in ("analyze", "train") and args.image_size is None
            if defaulted:
                args.image_size = entry.default_size
                log.info(
                    "[LMS] %s at its default size, %s (--image-size or --seq-len sets another)",
                    args.model,
                    entry.sized(args.image_size),
                )
            if args.command == "sweep" and args.step is None:
                if args.start is None:
                    raise ValueError(
                        "lms: sweep needs --step, the edge's (or length's) increment, or a first "
                        "size (--start, --seq-len) to grow by"
                    )
                args.step = args.start
            if defaulted:
                args.image_size = entry.first_size_taken(args.image_size, args.batch_size)
            if args.batch_size is None:
                args.batch_size = entry.default_batch(
                    getattr(args, "image_size", None) or entry.default_size
                )
        os.makedirs(getattr(args, "out", ".") or ".", exist_ok=True)
        _check_outputs(args)
        _check_extras(args)
        return int(args.run(args))
    except PlanInfeasibleError as error:  # the budget is below what the step needs with LMS
        print(error, file=sys.stderr)
        return EXIT_NO_PLAN
    except (LMSError, ValueError) as error:
        if not str(error).startswith("lms:"):  # not one of ours: a bug, with its traceback
            raise
        print(error, file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
