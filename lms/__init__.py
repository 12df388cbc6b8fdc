"""Large Model Support for PyTorch: train past device memory by offloading saved activations.

The names below load on first use (PEP 562), so that importing one layer of the package, say
`lms.core` or `lms.analysis`, loads that layer and those below it, not the runtime or the tuner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lms.core.version import __version__

if TYPE_CHECKING:
    from lms.analysis import DeviceSpec, Trace, device_spec, simulate
    from lms.core.config import LMSConfig
    from lms.core.errors import (
        HostMemoryError,
        LMSError,
        PlanInfeasibleError,
        SavedTensorChangedError,
        SpillError,
        StepAbortedError,
        StepFailedError,
        StepStateError,
        UnplannableStepError,
    )
    from lms.core.plan import Plan
    from lms.core.units import format_bytes, parse_bytes
    from lms.orchestration.analyze import Report, analyze
    from lms.orchestration.session import LMS
    from lms.runtime import LMSStats, no_offload, no_offload_in

_WHERE = {
    "LMS": "lms.orchestration.session",
    "LMSStats": "lms.runtime",
    "no_offload": "lms.runtime",
    "no_offload_in": "lms.runtime",
    "LMSConfig": "lms.core.config",
    "analyze": "lms.orchestration.analyze",
    "Report": "lms.orchestration.analyze",
    "simulate": "lms.analysis",
    "Trace": "lms.analysis",
    "DeviceSpec": "lms.analysis",
    "device_spec": "lms.analysis",
    "Plan": "lms.core.plan",
    "LMSError": "lms.core.errors",
    "SpillError": "lms.core.errors",
    "HostMemoryError": "lms.core.errors",
    "PlanInfeasibleError": "lms.core.errors",
    "SavedTensorChangedError": "lms.core.errors",
    "StepAbortedError": "lms.core.errors",
    "StepFailedError": "lms.core.errors",
    "StepStateError": "lms.core.errors",
    "UnplannableStepError": "lms.core.errors",
    "parse_bytes": "lms.core.units",
    "format_bytes": "lms.core.units",
}

__all__ = [
    "LMS",
    "LMSStats",
    "no_offload",
    "no_offload_in",
    "LMSConfig",
    "analyze",
    "Report",
    "simulate",
    "Trace",
    "DeviceSpec",
    "device_spec",
    "Plan",
    "LMSError",
    "SpillError",
    "HostMemoryError",
    "PlanInfeasibleError",
    "SavedTensorChangedError",
    "StepAbortedError",
    "StepFailedError",
    "StepStateError",
    "UnplannableStepError",
    "parse_bytes",
    "format_bytes",
    "__version__",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'lms' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
