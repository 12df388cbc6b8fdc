import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_script(script, *args, timeout=600):
    """Run ``script`` in a fresh Python process (where this repository's ``tests`` imports) with
    ``args``; its standard output. A process of its own measures memory from nothing else's."""
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    ).stdout


def script_json(script, *args, timeout=600):
    """`run_script`, and the JSON of its output's last line."""
    return json.loads(run_script(script, *args, timeout=timeout).strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _plan_cache(tmp_path_factory, monkeypatch):
    """Plans the tests tune go to a folder of each test's own, never to the user's cache (a plan
    kept there from an earlier run would be loaded instead of tuned)."""
    monkeypatch.setenv("LMS_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache")))


@pytest.fixture
def spill_dir(tmp_path):
    folder = tmp_path / "spill"
    folder.mkdir()
    yield str(folder)


def run_step(model, inputs, ctx=None, *, seed=0, loss_fn=None, retain=False):
    """One forward + backward; returns (loss, grads) detached and cloned."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = model(*inputs)
        loss = loss_fn(out) if loss_fn else out.float().square().mean()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss.detach().clone(), grads


def same_bits(a, b):
    """Whether two tensors hold the same bits: ``torch.equal`` takes -0.0 for 0.0 and never
    matches a NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


def assert_bitwise(ref, got):
    assert same_bits(ref[0], got[0]), (ref[0], got[0])
    assert len(ref[1]) == len(got[1])
    for a, b in zip(ref[1], got[1], strict=True):
        assert same_bits(a, b)


def assert_followed(plan, stats, steps):
    """``plan`` moves something and each of ``steps`` steps did what it says, no more.

    A plan tuned on this CPU spills or recomputes a storage by this machine's measured disk and
    compute rates, so which of the two it chooses is not the test's to fix."""
    assert plan.offload or plan.recompute, plan
    assert stats.diverged_steps == 0, stats
    assert stats.offloaded_tensors == steps * len(plan.offload), stats
    assert stats.recomputed_tensors == steps * len(plan.recompute), stats


def spill_files(folder):
    """What is on disk under ``folder`` (files and folders, named), and the unnamed spill files
    this process holds open there (Note [Spill files have no name]): a descriptor's link reads
    ``<folder>/#<inode> (deleted)``."""
    named = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs] + [
        d for d, _, _ in os.walk(folder) if d != folder
    ]
    return named + open_spill_files(folder)


def open_spill_files(folder):
    """The unnamed files under ``folder`` this process holds open."""
    found = []
    root = os.path.realpath(folder)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root + os.sep) and target.endswith("(deleted)"):
            found.append(target)
    return found


def hooks_are_gone():
    """Nothing of the runtime is left registered with torch."""
    from torch.nn.modules import module

    probe = torch.randn(8, requires_grad=True)
    out = probe.exp()  # saved under whatever hooks are still active
    node = out.grad_fn
    assert not module._global_forward_pre_hooks
    return type(node._saved_result) is torch.Tensor


def midway_budget(trace, spec):
    """A budget halfway between the peak with every saved storage moved (what stays is the
    floor) and the peak with none moved, beside the buffers the step's libraries keep where
    ``spec``'s timings measured them (Note [Buffers a library keeps]): a plan must move some,
    and some plan fits."""
    from lms.analysis import simulate
    from lms.analysis.simulate import library_kept_bytes
    from lms.planning.candidates import Candidates
    from lms.planning.minimum import smallest_plan

    _, everything_out = smallest_plan(Candidates(trace, spec, budget_bytes=2**40))
    midway = (everything_out.peak_bytes + simulate(trace, None, spec).peak_bytes) // 2
    return midway + library_kept_bytes(trace, spec)


def tuned_cpu_spec(trace):
    """The spec `lms.LMS.tune` prices a CPU step on: the one before its ops are timed, with
    ``trace``'s ops timed here and the scratch each takes."""
    from lms.orchestration.local import with_local_timings
    from lms.orchestration.tuning import priced_spec

    cpu = torch.device("cpu")
    return with_local_timings(priced_spec(cpu), trace, cpu)


def recomputing_plan(trace):
    """Every recipe whose inputs are not recomputed themselves recomputed, the rest offloaded."""
    from lms.analysis import device_spec
    from lms.core.recipes import recipes
    from lms.planning.candidates import Candidates

    found = recipes(trace)
    chosen: set[int] = set()
    for ordinal, recipe in sorted(found.items()):
        if not set(recipe.inputs) & chosen and not any(ordinal in found[c].inputs for c in chosen):
            chosen.add(ordinal)
    candidates = Candidates(trace, device_spec("cpu"), budget_bytes=2**40)
    return candidates.plan(range(candidates.num_entries), source="test", recompute=chosen)


def check_schema(command, data):
    """Validate ``data``, what ``lms COMMAND --json`` wrote, against the command's JSON schema
    (``lms/schemas/COMMAND.schema.json``), whose every key is documented."""
    import json
    import pathlib

    import jsonschema

    folder = pathlib.Path(__file__).resolve().parents[1] / "lms" / "schemas"
    schema = json.loads((folder / f"{command}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)
