"""Where tuned plans are kept between runs, and when a kept plan may be used again.

A plan is filed under the step's fingerprint, the device budget, and a short hash of what else
chose it: the device (a GPU's name and memory), the lms release and the code of its planners and
simulator (`planner_code`), half precision, the planner.
A plan found there is used only if it still names the step's saved tensors and the simulator
still predicts it fits the budget (Note [A cached plan is checked, not trusted]); otherwise it is
tuned again and replaced. Plans are written whole or not at all, so a run cut short leaves no
half-written file behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence

from lms.analysis.simulate import simulate
from lms.core.devices import DeviceSpec, OpTimings
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.core.units import format_bytes

__all__ = [
    "ENV_VAR",
    "cache_folder",
    "cache_path",
    "load_cached",
    "load_timings",
    "planner_code",
    "save_plan",
]

log = logging.getLogger("lms.orchestration.tuning")
ENV_VAR = "LMS_CACHE_DIR"
"""Environment variable naming the plan cache folder (default: the user's cache folder for
``lms``, as `platformdirs` finds it, then ``plans``: ``~/.cache/lms/plans`` on Linux)."""


def cache_folder(cache_dir: str | None = None) -> str:
    """The plan cache: ``cache_dir``, else ``$LMS_CACHE_DIR``, else the user's cache folder for
    ``lms`` (``~/.cache/lms/plans`` on Linux, ``$XDG_CACHE_HOME`` honoured; the platform's own
    elsewhere)."""
    if cache_dir or os.environ.get(ENV_VAR):
        return cache_dir or os.environ[ENV_VAR]
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("lms", appauthor=False), "plans")


@functools.cache
def planner_code() -> str:
    """A short hash of the sources that choose and check plans (``lms/core``, ``lms/analysis``
    and ``lms/planning``, each file at any depth): a plan kept by other code is tuned again,
    though the release is the same (an editable install, a checkout moved on), and would
    otherwise be followed as it was."""
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = []
    for package in ("core", "analysis", "planning"):
        for folder, _, names in os.walk(os.path.join(root, package)):
            sources += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    for path in sorted(sources):
        with open(path, "rb") as source:
            digest.update(f"{os.path.relpath(path, root)}\0".encode() + source.read())
    return digest.hexdigest()[:12]


def cache_path(folder: str, trace: Trace, budget_bytes: int, setting: Sequence[object]) -> str:
    """The file a plan for ``trace`` under ``budget_bytes`` and ``setting`` is kept in.

    ``setting`` is whatever else chose the plan (device, release, precision, planner); only its
    hash is in the name.
    """
    tag = hashlib.sha256(json.dumps([str(part) for part in setting]).encode()).hexdigest()[:8]
    return os.path.join(folder, f"{trace.fingerprint()}-{budget_bytes}-{tag}.json")


# Note: [A cached plan is checked, not trusted]
# The fingerprint names the step's shape, not the code that planned it: a plan kept by an earlier
# release (or written by hand, or cut short) may name other tensors or no longer fit. One
# simulation, far cheaper than tuning, tells; a plan that fails is tuned again, never followed.
def cached_slabs(path: str) -> tuple[tuple[str, int], ...]:
    """The submodules the plan kept at ``path`` runs in slabs (`Plan.slabs`): the step must be
    traced so to check that plan; none where there is no readable plan."""
    try:
        return Plan.load(path).slabs
    except (OSError, ValueError, TypeError, KeyError):
        return ()


def load_cached(
    path: str,
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    free_held: bool = False,
) -> Plan | None:
    """The plan kept at ``path`` if there is one, made for the settings in force (``free_held``)
    and still fitting; None to tune again."""
    if not os.path.exists(path):
        return None
    try:
        plan = Plan.load(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        log.warning("[LMS] Tuning again: the cached plan %s cannot be read (%s)", path, error)
        return None
    entries = len(trace.entries())
    if plan.fingerprint != trace.fingerprint() or plan.num_entries != entries:
        log.warning(
            "[LMS] Tuning again: the cached plan %s was made for another step (%d saved storages,"
            " this step has %d)",
            path,
            plan.num_entries,
            entries,
        )
        return None
    if plan.free_held and not free_held:
        log.warning(
            "[LMS] Tuning again: the cached plan %s empties tensors the step's code holds, and "
            "free_held is off",
            path,
        )
        return None
    peak = simulate(trace, plan, spec, half=half).peak_bytes
    if peak > budget_bytes:
        log.warning(
            "[LMS] Tuning again: the cached plan %s is now predicted to need %s, over the budget"
            " of %s",
            path,
            format_bytes(peak),
            format_bytes(budget_bytes),
        )
        return None
    return plan


def save_plan(plan: Plan, path: str, timings: OpTimings | None = None) -> None:
    """Write ``plan`` to ``path`` whole: to a temporary file in the same folder, then renamed;
    and beside it the op times it was priced at, if any (`load_timings`)."""
    if timings is not None:
        _write_whole(_times_path(path), json.dumps(timings.to_dict()))
    _write_whole(path, plan.to_json())


# Note: [A cached plan keeps its op times]
# A plan tuned on the device it runs on is priced at its ops' measured times (Note [Ops timed on
# the device]), which take seconds to minutes to measure. A plan loaded from the cache is priced
# again for what the run reports (its predicted step, the record's), and at the rates alone it
# came out a third lower than when it was tuned, for the same plan. So the times are kept beside
# the plan, named by the trace they were measured on, and the loaded plan is priced at them.
def load_timings(path: str, trace: Trace) -> OpTimings | None:
    """The op times kept beside the plan at ``path`` (`save_plan`), if they are ``trace``'s;
    None otherwise (the rates price its ops)."""
    try:
        with open(_times_path(path)) as handle:
            data = json.load(handle)
        timings = OpTimings.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if timings.fingerprint != trace.fingerprint() or len(timings.seconds) != len(trace.ops):
        return None
    return timings


def _times_path(path: str) -> str:
    return f"{os.path.splitext(path)[0]}.times.json"


def _write_whole(path: str, text: str) -> None:
    """``text`` at ``path``, written to a temporary file in the same folder, then renamed."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".plan-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
