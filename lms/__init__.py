"""Large Model Support for PyTorch: train past device memory by offloading saved activations."""

from lms._units import format_bytes, parse_bytes
from lms.analysis import DeviceSpec, Report, Trace, analyze, device_spec, simulate
from lms.config import LMSConfig
from lms.errors import (
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
from lms.plan import Plan
from lms.runtime import LMS, LMSStats, no_offload, no_offload_in

__all__ = [
    "LMS",
    "LMSConfig",
    "LMSStats",
    "no_offload",
    "no_offload_in",
    "analyze",
    "Report",
    "simulate",
    "Trace",
    "Plan",
    "DeviceSpec",
    "device_spec",
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
]
__version__ = "0.1.0"
