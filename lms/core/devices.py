"""Device specs: memory, peak rates and copy bandwidth of the machines plans are made for."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lms.core.units import bucket_bytes, parse_bytes

__all__ = [
    "DeviceSpec",
    "DEVICES",
    "FRESH_PAGES_BYTES",
    "LINK_MARGIN",
    "MAPPED_ALONE_BYTES",
    "OpTimings",
    "device_spec",
]

GiB = 1024**3
FRESH_PAGES_BYTES = 32 * 1024**2
"""glibc's largest threshold for mapping an allocation anew (`DeviceSpec.fresh_memory_gbps`)."""
MAPPED_ALONE_BYTES = 1024**2
"""The threshold a runtime with a CPU budget fixes instead (`lms.LMSConfig.cpu_resident`; Note [The
resident set follows the heap under a budget]), which the "cpu" spec counts."""


# Note: [A plan's margin on the link]
# A plan is priced at the link's and the disk's rates as the spec gives them (a datasheet's, or
# measured on the card), and copies reach less under contention (another process's transfers,
# a shared PCIe switch, a busy page cache). The report prices the same plan again with both at
# 80% of their rates, so that a plan whose copies hide behind compute with no room to spare
# shows it: the time that plan would take, not another plan made for the slower link.
LINK_MARGIN = 0.8


@dataclasses.dataclass(frozen=True, eq=False)
class OpTimings:
    """Seconds each op of one trace took, run alone on the device
    (`lms.orchestration.timing.time_ops`).

    Compared and hashed by identity: a spec that carries them stays a cheap key.
    """

    fingerprint: str
    """`lms.core.records.Trace.fingerprint` of the trace timed."""
    seconds: tuple[float | None, ...]
    """By op index; None for an op not timed (priced by the spec's rates)."""
    scratch: tuple[int | None, ...] = ()
    """By op index, the bytes each op took beyond its tensors while it ran (Note [An op's
    scratch, measured where it is timed] in `lms.orchestration.timing`), which the simulator
    counts for a spec with `DeviceSpec.cpu_scratch`; None for an op not measured, empty where
    none was."""
    kept: tuple[int | None, ...] = ()
    """By op index, the bytes a distinct call's first run left allocated once its outputs were
    freed: buffers a library keeps for later calls (Note [Buffers a library keeps] in
    `lms.orchestration.timing`), at the first op of each distinct call (0 at the others); None
    for an op not measured, empty where none was."""

    @property
    def timed(self) -> int:
        """How many ops have a time."""
        return sum(s is not None for s in self.seconds)

    def to_dict(self) -> dict[str, Any]:
        """As JSON keeps them (`from_dict` reads it back)."""
        return (
            {"fingerprint": self.fingerprint, "seconds": list(self.seconds)}
            | ({"scratch": list(self.scratch)} if self.scratch else {})
            | ({"kept": list(self.kept)} if self.kept else {})
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpTimings:
        """From `to_dict`'s; one written before scratch (or kept buffers) was measured has none.

        Raises:
            KeyError, TypeError, ValueError: ``data`` is not one `to_dict` wrote.
        """
        return cls(
            fingerprint=str(data["fingerprint"]),
            seconds=tuple(None if s is None else float(s) for s in data["seconds"]),
            scratch=tuple(None if b is None else int(b) for b in data.get("scratch", ())),
            kept=tuple(None if b is None else int(b) for b in data.get("kept", ())),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """What the simulator needs to know of a device and its link to host memory (or disk)."""

    name: str
    """Short key, as in ``"v100-32gb-nvlink"``."""
    memory_bytes: int
    """Device memory."""
    peak_flops: float
    """Dense fp32 (or tf32 where used by default) rate, FLOP/s: the datasheet's peak, or on the
    local device what a convolution reaches (`lms.orchestration.local.local_device_spec`)."""
    peak_flops_half: float
    """fp16/bf16 tensor-core rate, FLOP/s (likewise)."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth, GB/s (likewise)."""
    d2h_gbps: float
    """Copy bandwidth device to host (or to disk for "cpu"), GB/s per direction."""
    h2d_gbps: float
    """Copy bandwidth host to device (or from disk), GB/s per direction."""
    link: str
    """The link, in words."""
    workspace_bytes: int = 0
    """Memory libraries take on top of tensors (cuDNN/cuBLAS workspaces), kept free."""
    alloc_round_bytes: int = 512
    """The caching allocator's rounding of each block."""
    page_mapped_bytes: int | None = None
    """Storages of at least this many bytes get pages of their own from the C allocator, one
    page (4096 bytes) more than their bytes, its header's (Note [A mapped storage's own page]),
    and fault them in afresh (Note [Fresh pages]): `MAPPED_ALONE_BYTES` on the "cpu" spec, as a
    runtime with a budget sets it (`FRESH_PAGES_BYTES`, glibc's own largest, with
    ``cpu_resident=False``); None where blocks are only rounded."""
    graph_bytes_per_op: int = 0
    """Memory each forward op's share of the autograd graph takes beside the tensors, until
    backward ends (Note [The autograd graph on a CPU's heap]): the "cpu" spec, whose budget counts
    the C heap; 0 on a GPU, whose graph is in host memory."""
    op_overhead_s: float = 5e-6
    """Launch cost of one op."""
    write_log_op_s: float = 0.0
    """What the runtime's write log (a dispatch mode that sees every op while a plan recomputes
    anything) adds to each op of the step (Note [The write log's own cost]); 0 where the host
    queues work ahead of the device and the log's Python runs in that slack."""
    host_memory_bytes: int | None = None
    """Host memory for offloaded data; beyond it planners spill to disk. None: no limit."""
    disk_write_gbps: float = 2.0
    """Spill-file write rate, GB/s (a local NVMe drive)."""
    disk_read_gbps: float = 3.0
    """Spill-file read rate, GB/s."""
    checksum_gbps: float | None = 10.0
    """Rate, GB/s, at which the host digests a spill file as it is written and again as it is
    read back (Note [Spill files are checked when read back]; benchmarks/checksum.py); None where
    the spill rates already include it (the "cpu" spec, whose rates are measured through the
    spill store itself)."""
    cpu_scratch: bool = False
    """Ops take the CPU's scratch memory on top of their tensors while they run
    (`lms.core.records.OpRecord.cpu_scratch_bytes`): the "cpu" spec."""
    fresh_memory_gbps: float | None = None
    """Rate, GB/s, at which an op first writes memory the allocator maps for it anew, on top of
    its traffic (Note [Fresh pages]): the "cpu" spec, for storages of at least
    `page_mapped_bytes`; None where that costs nothing more (a GPU's caching allocator)."""
    fresh_read_gbps: float | None = None
    """Rate, GB/s, at which a read back first writes memory the allocator maps for it anew, on
    top of the read (Note [Fresh pages]): the "cpu" spec, for storages of at
    least `page_mapped_bytes`; None where that costs nothing more."""
    copies_take_compute: bool = False
    """Copies run on a host thread that takes a core the step's compute needs, so compute loses
    each copy's time (Note [Copies on a CPU take its cores]): the "cpu" spec while PyTorch's
    threads fill every core; on a GPU, copy engines move the data."""

    op_timings: OpTimings | None = dataclasses.field(default=None, repr=False)
    """Times of the ops of one trace measured on this device; the simulator takes them, in place
    of its rates, for that trace alone (Note [Ops timed on the device])."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON keeps them (`from_dict` reads it back)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["op_timings"] = None if self.op_timings is None else self.op_timings.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "the spec") -> DeviceSpec:
        """From `to_dict`'s, or any mapping of its fields: ``"base"`` names a known spec whose
        fields the others replace, else every field without a default is given.

        Raises:
            ValueError: a field unknown, missing or of the wrong type, named with ``source``.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields) - {"base"})
        if unknown:
            raise ValueError(
                f"lms: {source} has no field {', '.join(map(repr, unknown))}; a device spec's "
                f"fields: {', '.join(fields)}, or 'base' (a known spec's name) to start from"
            )
        values = dict(data)
        base = values.pop("base", None)
        if base is not None:
            values = device_spec(str(base)).to_dict() | values
        missing = [
            name
            for name, f in fields.items()
            if name not in values
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(
                f"lms: {source} lacks {', '.join(map(repr, missing))}: give them, or 'base' "
                f"(a known spec's name, as 'h100') for the fields not given"
            )
        timings = values.pop("op_timings", None)
        for name, value in values.items():
            _check_field(fields[name], value, source)
        spec = cls(**values)
        return spec if timings is None else spec.with_op_timings(OpTimings.from_dict(timings))

    def with_memory(self, memory: int | str) -> DeviceSpec:
        """The same device with another memory size (a limited or a larger card)."""
        return dataclasses.replace(self, memory_bytes=parse_bytes(memory, field="gpu_memory"))

    def with_host_memory(self, memory: int | str | None) -> DeviceSpec:
        """The same device with ``memory`` of host memory for offloaded data (None: no limit)."""
        host = None if memory is None else parse_bytes(memory, field="host_memory")
        return dataclasses.replace(self, host_memory_bytes=host)

    def with_link_scaled(self, factor: float) -> DeviceSpec:
        """The same device with its link to host memory, and its spill disk, ``factor`` times
        as fast."""
        return dataclasses.replace(
            self,
            d2h_gbps=self.d2h_gbps * factor,
            h2d_gbps=self.h2d_gbps * factor,
            disk_write_gbps=self.disk_write_gbps * factor,
            disk_read_gbps=self.disk_read_gbps * factor,
        )

    def with_op_timings(self, timings: OpTimings | None) -> DeviceSpec:
        """The same device with the measured times of one trace's ops."""
        return dataclasses.replace(self, op_timings=timings)

    def host_copy_bytes(self, nbytes: int) -> int:
        """Host memory an offloaded copy of ``nbytes`` takes: on a GPU, the runtime's pinned
        pool serves it from a bucket (`lms.core.units.bucket_bytes`: up to 2 MiB more, and up to
        twice the bytes below 2 MiB); on "cpu", a spill file of exactly its bytes."""
        return nbytes if self.name == "cpu" else bucket_bytes(nbytes)

    @property
    def spills(self) -> bool:
        """Whether offloaded data can overflow host memory to disk (not for "cpu", whose
        offloads already go to disk)."""
        return self.name != "cpu" and self.host_memory_bytes is not None


def _gpu(
    name: str, mem_gib: float, fp32: float, half: float, hbm: float, link_gbps: float, link: str
) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        memory_bytes=int(mem_gib * GiB),
        peak_flops=fp32 * 1e12,
        peak_flops_half=half * 1e12,
        memory_bandwidth_gbps=hbm,
        d2h_gbps=link_gbps,
        h2d_gbps=link_gbps,
        link=link,
        workspace_bytes=512 * 1024**2,
    )


# Link rates are per direction as measured in practice, not the marketing sum of both. Compute
# is the datasheet's dense rate: for fp32 the TF32 tensor cores' where the card has them (PyTorch's
# convolutions take TF32 by default), for half precision bf16's with fp32 accumulation.
DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _gpu("v100-16gb-nvlink", 16, 15.7, 125, 900, 68.0, "NVLink 2.0 (150 GB/s, 3 bricks)"),
        _gpu("v100-32gb-nvlink", 32, 15.7, 125, 900, 68.0, "NVLink 2.0 (150 GB/s, 3 bricks)"),
        _gpu("v100-16gb-pcie3", 16, 14.0, 112, 900, 12.0, "PCIe Gen3 x16"),
        _gpu("v100-32gb-pcie3", 32, 14.0, 112, 900, 12.0, "PCIe Gen3 x16"),
        _gpu("a100-40gb", 40, 19.5 * 8, 312, 1555, 24.0, "PCIe Gen4 x16"),
        _gpu("a100-80gb", 80, 19.5 * 8, 312, 2039, 24.0, "PCIe Gen4 x16"),
        _gpu("h100-80gb", 80, 67 * 7, 989, 3350, 52.0, "PCIe Gen5 x16"),
        _gpu("h200-141gb", 141, 67 * 7, 989, 4800, 52.0, "PCIe Gen5 x16"),
        _gpu("gh200-96gb", 96, 67 * 7, 989, 4000, 400.0, "NVLink-C2C"),
        _gpu("b200-180gb", 180, 1100, 2250, 8000, 52.0, "PCIe Gen5 x16"),
        _gpu("l4-24gb", 24, 60, 121, 300, 24.0, "PCIe Gen4 x16"),
        _gpu("a10-24gb", 24, 62.5, 125, 600, 24.0, "PCIe Gen4 x16"),
        _gpu("l40s-48gb", 48, 183, 362, 864, 24.0, "PCIe Gen4 x16"),
        _gpu("rtx4090-24gb", 24, 82.6, 165.2, 1008, 24.0, "PCIe Gen4 x16"),
        DeviceSpec(
            name="cpu",
            memory_bytes=24 * GiB,
            peak_flops=60e9,
            peak_flops_half=30e9,
            memory_bandwidth_gbps=15.0,
            d2h_gbps=1.5,
            h2d_gbps=3.0,
            link="spill files (page cache and disk)",
            op_overhead_s=20e-6,
            write_log_op_s=30e-6,
            cpu_scratch=True,
            page_mapped_bytes=MAPPED_ALONE_BYTES,
            graph_bytes_per_op=1536,
            fresh_memory_gbps=4.0,
            copies_take_compute=True,
            checksum_gbps=None,
        ),
    )
}
ALIASES = {
    "v100": "v100-32gb-nvlink",
    "v100-16gb": "v100-16gb-nvlink",
    "v100-32gb": "v100-32gb-nvlink",
    "a100": "a100-80gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "gh200": "gh200-96gb",
    "b200": "b200-180gb",
    "l4": "l4-24gb",
    "a10": "a10-24gb",
    "l40s": "l40s-48gb",
    "rtx4090": "rtx4090-24gb",
}


def device_spec(name: str, *, memory: int | str | None = None) -> DeviceSpec:
    """Look up a spec by name (or alias), or read one from a JSON file, optionally with another
    memory size.

    A name ending in ``.json`` is a file (Note [A device spec from a file]).

    Raises:
        ValueError: for an unknown name, listing the known ones; for a file that cannot be
            read or whose fields are not a spec's.
    """
    if name.lower().endswith(".json"):
        spec = _spec_file(name)
    else:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in DEVICES:
            known = ", ".join(sorted(DEVICES) + sorted(ALIASES))
            raise ValueError(
                f"lms: device_spec={name!r} is unknown; known: {known}, or a JSON file of a "
                f'spec\'s fields (as {{"base": "h100", "d2h_gbps": 25}})'
            )
        spec = DEVICES[key]
    return spec.with_memory(memory) if memory is not None else spec


# Note: [A device spec from a file]
# A card no spec names (or one whose link, measured, is slower than its datasheet's) is planned
# for from a JSON file of `DeviceSpec`'s fields: all of them, or "base", a known spec's name,
# and the fields that differ. A file `lms sweep --json` or `lms analyze --json` wrote serves as
# it is (its "device_spec", or its "spec": the spec it simulated, measured where it was
# "local"), so a card measured once (`lms analyze --device-spec local` on it) is planned for
# anywhere after. Op times measured for one trace are left out: another step's ops are not
# those, and the simulator prices them at the spec's rates.
def _spec_file(path: str) -> DeviceSpec:
    source = f"device_spec={path!r}"
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except FileNotFoundError:
        raise ValueError(
            f"lms: {source}: no such file; give a known spec's name or a JSON file of a "
            f"spec's fields"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"lms: {source} cannot be read as JSON: {error}") from None
    for key in ("spec", "device_spec"):  # what `lms analyze --json` or `lms sweep --json` wrote
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict):
        raise ValueError(f"lms: {source} holds {type(data).__name__}, not an object of fields")
    return DeviceSpec.from_dict({**data, "op_timings": None}, source=source)


def _check_field(field: dataclasses.Field[Any], value: Any, source: str) -> None:
    """Raise where ``value`` is not of the type ``field`` of `DeviceSpec` takes."""
    kinds = {
        "str": (str,),
        "int": (int,),
        "float": (int, float),
        "bool": (bool,),
        "int | None": (int, type(None)),
        "float | None": (int, float, type(None)),
    }
    wanted = kinds.get(str(field.type))
    if wanted is None:
        return
    if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
        raise ValueError(
            f"lms: {source}: {field.name}={value!r} is not a {field.type}"
            + (" (bytes, as a number)" if field.name.endswith("_bytes") else "")
        )
