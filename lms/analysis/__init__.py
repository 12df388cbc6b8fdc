"""Analysis: trace a step with fake tensors and simulate it on a device spec.

Sits on `lms.core` alone; the runtime and the planners are not imported here.
"""

from lms.analysis.simulate import SimResult, runtime_plan, simulate
from lms.analysis.trace import trace_step
from lms.core.devices import DEVICES, DeviceSpec, device_spec
from lms.core.records import OpRecord, SavedEvent, StorageRecord, Trace

__all__ = [
    "DeviceSpec",
    "DEVICES",
    "device_spec",
    "Trace",
    "OpRecord",
    "StorageRecord",
    "SavedEvent",
    "SimResult",
    "simulate",
    "runtime_plan",
    "trace_step",
]
