"""The pure core: trace a step with fake tensors, simulate it on a device spec, plan."""

from lms.analysis.analyze import Report, analyze, report_for
from lms.analysis.devices import DEVICES, DeviceSpec, device_spec
from lms.analysis.records import OpRecord, SavedEvent, StorageRecord, Trace
from lms.analysis.simulate import SimResult, runtime_plan, simulate
from lms.analysis.trace import trace_step

__all__ = [
    "analyze",
    "report_for",
    "Report",
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
