"""A step record: what a run measured of its steps, op by op, beside what it was planned from.

One file holds the trace the plan was made for, the plan, the device spec with the rates and op
times the tuner priced it at, and for each recorded step the start and end of every op, copy and
wait, and the memory in use after each op. `lms replay` simulates the plan again from it and sets
prediction against measurement (`lms.report.replay`). Written as gzipped JSON; each list of
records is stored as columns (field names once, then rows), which keeps a step of a few thousand
ops to some hundreds of KiB.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from typing import Any

from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.records import JunctionRecord, OpRecord, SavedEvent, StorageRecord, Trace

__all__ = [
    "CopyTime",
    "OpTime",
    "RECORD_FORMAT",
    "StepRecord",
    "StepTimes",
    "WaitTime",
    "load_record",
]

RECORD_FORMAT = "lms-step-record/1"


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One op the step ran, timed on the step's clock (seconds from the step's start)."""

    name: str
    """The overload, as in ``aten.convolution.default``."""
    section: str
    """``step`` (the model's own ops, which the trace has too), ``replay`` (a recomputation the
    plan asked for) or ``runtime`` (the runtime's own work inside its hooks)."""
    backward: bool
    start_s: float
    end_s: float
    allocated_bytes: int
    """Device memory allocated when the op ended; on a CPU, the C heap in use when the step
    began plus the storages the step's ops made and still held (Note [Memory in use at each op
    on a CPU])."""
    reserved_bytes: int
    """Device memory the caching allocator held then; 0 on a CPU."""


@dataclasses.dataclass(frozen=True)
class CopyTime:
    """One copy out of the device (``out``) or back in (``in``)."""

    direction: str
    ordinal: int
    """The saved entry's ordinal (`lms.Plan` names entries by it)."""
    nbytes: int
    tier: str
    """``host`` (pinned host memory) or ``disk`` (a spill file)."""
    queued_s: float
    """When the runtime asked for it."""
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class WaitTime:
    """Time an op stood waiting for an entry to come back (or for a copy out to free room)."""

    ordinal: int
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One recorded step."""

    number: int
    clock: str
    """``cuda-events`` (times are the card's, read from CUDA events) or ``wall``."""
    step_s: float
    """From entering the step's ``with`` block to leaving it."""
    start_bytes: int
    """Memory in use when the step began (allocated on a card; the C heap in use on a CPU)."""
    peak_bytes: int
    """Peak memory in use during the step, on the same count."""
    ops: tuple[OpTime, ...]
    copies: tuple[CopyTime, ...]
    waits: tuple[WaitTime, ...]
    stats: dict[str, float]
    """The runtime's counters for this step alone (`lms.LMSStats`)."""
    recorder_s: float = 0.0
    """Host seconds the recorder itself spent in the step's ops' dispatch (its marks and reads
    of memory in use), part of the time between ops; 0 in records written before it was kept."""
    recorder_reads_s: float = 0.0
    """Of ``recorder_s``, the reads of memory in use (the allocator's statistics on a card, the
    recorder's count of the storages made on a CPU)."""

    @property
    def growth_bytes(self) -> int:
        """How much the step added at most to what was in use when it began."""
        return self.peak_bytes - self.start_bytes


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """A run's record: what it was planned from and what its steps measured."""

    trace: Trace
    plan: Plan | None
    spec: DeviceSpec
    """The spec the plan was priced on, its op times (`DeviceSpec.op_timings`) included."""
    half: bool
    steps: tuple[StepTimes, ...]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Versions, the device's name, the command that ran."""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON-ready values."""
        return {
            "format": RECORD_FORMAT,
            "meta": self.meta,
            "trace": _trace_to_dict(self.trace),
            "plan": None if self.plan is None else dataclasses.asdict(self.plan),
            "spec": self.spec.to_dict(),
            "half": self.half,
            "steps": [_step_to_dict(step) for step in self.steps],
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the record to ``path`` as gzipped JSON (atomically: a partial file never
        stays)."""
        text = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        partial = f"{os.fspath(path)}.partial"
        try:
            with gzip.open(partial, "wb", compresslevel=6) as handle:
                handle.write(text)
            os.replace(partial, path)
        except BaseException:
            if os.path.exists(partial):
                os.remove(partial)
            raise

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        """A record from `to_dict`'s values."""
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(
                f"lms: not a step record of format {RECORD_FORMAT!r} "
                f"(found {data.get('format')!r}); write one with `lms train --record FILE`"
            )
        plan = data["plan"]
        return cls(
            trace=_trace_from_dict(data["trace"]),
            plan=None if plan is None else Plan.from_json(json.dumps(plan)),
            spec=DeviceSpec.from_dict(data["spec"]),
            half=bool(data["half"]),
            steps=tuple(_step_from_dict(step) for step in data["steps"]),
            meta=dict(data.get("meta", {})),
        )


def load_record(path: str | os.PathLike[str]) -> StepRecord:
    """Read a record `StepRecord.save` wrote.

    Raises:
        ValueError: the file is not a step record (or a record of another format).
    """
    try:
        with gzip.open(path, "rb") as handle:
            data = json.loads(handle.read())
    except (OSError, EOFError, json.JSONDecodeError) as error:
        raise ValueError(
            f"lms: {os.fspath(path)} is not a readable step record ({error}); write one with "
            "`lms train --record FILE`"
        ) from error
    if not isinstance(data, dict):
        raise ValueError(f"lms: {os.fspath(path)} is not a step record")
    return StepRecord.from_dict(data)


# -- columns ---------------------------------------------------------------------------------
def _columns(rows: Any, kind: type) -> dict[str, Any]:
    names = [field.name for field in dataclasses.fields(kind)]
    return {"fields": names, "rows": [[getattr(row, name) for name in names] for row in rows]}


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _rows(table: dict[str, Any], kind: type) -> tuple[Any, ...]:
    names = table["fields"]
    return tuple(
        kind(**{name: _tupled(value) for name, value in zip(names, row, strict=True)})
        for row in table["rows"]
    )


_TRACE_TABLES = {
    "ops": OpRecord,
    "storages": StorageRecord,
    "events": SavedEvent,
    "junctions": JunctionRecord,
}
_STEP_TABLES = {"ops": OpTime, "copies": CopyTime, "waits": WaitTime}


def _tabled(record: Any, tables: dict[str, type], leave: tuple[str, ...] = ()) -> dict[str, Any]:
    """A frozen record's fields as JSON-ready values, its lists of records as `_columns`."""
    data: dict[str, Any] = {
        field.name: getattr(record, field.name)
        for field in dataclasses.fields(record)
        if field.name not in tables and field.name not in leave
    }
    data.update({name: _columns(getattr(record, name), kind) for name, kind in tables.items()})
    return data


def _untabled(data: dict[str, Any], tables: dict[str, type]) -> dict[str, Any]:
    """`_tabled`'s values back, as a record's keyword arguments."""
    values = dict(data)
    values.update({name: _rows(data[name], kind) for name, kind in tables.items()})
    return values


def _trace_to_dict(trace: Trace) -> dict[str, Any]:
    return _tabled(trace, _TRACE_TABLES, leave=("calls", "modules"))


def _trace_from_dict(data: dict[str, Any]) -> Trace:
    values = _untabled(data, _TRACE_TABLES)
    values["input_shapes"] = _tupled(data["input_shapes"])
    values["slabs"] = _tupled(data.get("slabs", []))
    return Trace(**values)


def _step_to_dict(step: StepTimes) -> dict[str, Any]:
    return _tabled(step, _STEP_TABLES)


def _step_from_dict(data: dict[str, Any]) -> StepTimes:
    return StepTimes(**_untabled(data, _STEP_TABLES))
