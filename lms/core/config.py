"""`LMSConfig`: the runtime's settings, validated once, in TFLMS v2's vocabulary.

Levels in eager mode. PyTorch runs no graph that could be sorted into topological levels, so a
*level* here is a position in the step's sequence of saved-tensor events: every time autograd saves
a tensor (the pack hook) or reads one back in backward (the unpack hook) the level advances by one.
A tensor saved at level ``s`` and first read back at level ``u`` has distance ``u - s``; the last
tensor saved before backward has distance 1. Until a step has been recorded, the runtime assumes
backward reads tensors back in the reverse of the order they were saved.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from typing_extensions import TypedDict

from lms.core.sync import SyncMode
from lms.core.units import parse_bytes, parse_share

__all__ = [
    "LMSConfig",
    "LMSSettings",
    "SyncModes",
    "Tier",
    "AUTO_MIN_OFFLOAD_BYTES",
    "AUTO_SWAPIN_AHEAD",
]

Tier = Literal["auto", "host", "disk"]
SyncModes = SyncMode | Literal[0, 1, 2, 3]
"""A `SyncMode`, or TFLMS's number for it."""
AUTO_MIN_OFFLOAD_BYTES = 256 * 1024
AUTO_SWAPIN_AHEAD = 2


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    allowed = f"-1 (automatic) or an integer >= {low}" if low > -1 else ""
    if high is not None:
        allowed = f"an integer from {low} to {high}"
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and value == -1 and low > -1 and high is None:
        return
    if not ok or value < low or (high is not None and value > high):  # type: ignore[operator]
        raise ValueError(f"lms: {name}={value!r} is out of range; allowed: {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMSConfig:
    """Settings of one `lms.LMS` runtime. Sizes accept bytes or strings such as ``"10GiB"``."""

    budget: int | str | None = None
    """Device memory the step may use (bytes), its weights, batch and gradients included but not
    optimizer state, which needs room of its own; None means no limit (offload by threshold
    only). A percent such as ``"60%"`` is that share of the step's peak of tensors without
    offload, as simulated from its trace, with the workspace the device keeps free for libraries
    on top (`lms.analysis.simulate.share_of_peak`): `lms.LMS.tune` sets the budget in bytes from
    it (`budget_share`)."""
    tier: Tier = "auto"
    """Where offloaded data goes: "auto" (host memory from a CUDA device, disk from the CPU),
    "host" (pinned host memory only) or "disk" (spill files)."""
    swapout_threshold: int = -1
    """Offload a saved tensor whose distance in levels to its first use is at least this;
    -1: by budget."""
    swapin_ahead: int = -1
    """Start bringing a tensor back this many uses before backward needs it; -1: auto (2)."""
    swapin_groupby: int = -1
    """Tensors used within this many levels after a prefetched one come back with it; -1: 0."""
    sync_mode: SyncModes = SyncMode.ASYNC
    """How the step waits for its copies, a `SyncMode`: 0 asynchronous copies, 1 wait for each
    copy out, 2 no prefetch (copy in on demand), 3 both."""
    min_offload_bytes: int | str = -1
    """Saved tensors smaller than this stay on the device; -1: automatic (256 KiB)."""
    spill_dir: str | None = None
    """Folder for spill files; None: the system's temporary folder."""
    spill_reserve: int | str = 64 * 1024**2
    """Free space a spill folder keeps beyond the spill files, for the rest of the system: a
    write that would leave less raises `SpillError` (default 64 MiB)."""
    host_budget: int | str | None = None
    """Host memory that offloaded data may hold; None: half of the memory available at start.
    With tier "auto" the rest overflows to disk; with tier "host" it is an error."""
    free_held: bool = False
    """Let a tuned plan empty the device memory behind tensors the step's code still holds but
    no longer reads (the input batch, a block's input in a local), filling them again in place
    when backward reads them (Note [Emptying what the code holds]). The trace of `LMS.tune`
    sees every read inside the step; code outside it must not read such a tensor between
    forward and backward (logging the batch in between, a forward-only step under the block):
    PyTorch reads an emptied storage without a check, and the process may crash."""

    slabs: bool = True
    """Where no plan of the whole step fits the budget, let a tuned plan run submodules in
    slabs along their first spatial dimension (Note [Slabs], Note [Which submodules run in
    slabs]). Their gradients are then within float rounding of the whole module's, not bit for
    bit; False refuses such a budget instead."""

    cpu_resident: bool = True
    """With a budget on the CPU: hold it for the process's resident set, not only for the C heap
    in use, by giving memory back to the system as it is freed (Note [The resident set follows
    the heap under a budget]). Steps whose tensors are large take longer, as their pages are
    faulted in afresh; False keeps the C allocator's own setting (faster; the resident set may
    then pass the budget by what the allocator keeps)."""

    budget_share: float | None = dataclasses.field(default=None, init=False)
    """The share of the step's simulated peak a budget such as ``"60%"`` asks for, until
    `lms.LMS.tune` turns it into bytes; None for a budget given in bytes."""

    def refuse_share(self, untraced: str) -> None:
        """Refuse a budget given as a share of the peak where no trace will tell the peak.

        Args:
            untraced: why the step is not traced, and the setting, as a user names them
                ("offload_trainer(tune=False)").

        Raises:
            ValueError: ``budget`` is a share, such as ``"60%"``.
        """
        if self.budget_share is not None:
            raise ValueError(
                f"lms: budget='{100 * self.budget_share:g}%' is a share of the step's peak "
                f"without offload, which only a trace of the step tells, and {untraced}; give "
                "the budget as a size, such as '10GiB'"
            )

    def __post_init__(self) -> None:
        share = parse_share(self.budget)
        if share is not None:
            object.__setattr__(self, "budget_share", share)
            object.__setattr__(self, "budget", None)
        elif self.budget is not None:
            object.__setattr__(self, "budget", parse_bytes(self.budget, field="budget"))
        if self.host_budget is not None:
            object.__setattr__(
                self, "host_budget", parse_bytes(self.host_budget, field="host_budget")
            )
        object.__setattr__(
            self, "spill_reserve", parse_bytes(self.spill_reserve, field="spill_reserve")
        )
        if isinstance(self.min_offload_bytes, str):
            object.__setattr__(
                self,
                "min_offload_bytes",
                parse_bytes(self.min_offload_bytes, field="min_offload_bytes"),
            )
        if self.tier not in ("auto", "host", "disk"):
            raise ValueError(
                f"lms: tier={self.tier!r} is not a tier; allowed: 'auto', 'host' or 'disk'"
            )
        _check_int("swapout_threshold", self.swapout_threshold, 1)
        _check_int("swapin_ahead", self.swapin_ahead, 1)
        _check_int("swapin_groupby", self.swapin_groupby, 0)
        _check_int("sync_mode", self.sync_mode, 0, 3)
        _check_int("min_offload_bytes", self.min_offload_bytes, 0)
        for name in ("free_held", "slabs", "cpu_resident"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"lms: {name}={getattr(self, name)!r} is not True or False")
        if self.spill_dir is not None and not isinstance(self.spill_dir, (str, os.PathLike)):
            raise ValueError(f"lms: spill_dir={self.spill_dir!r} is not a path")
        if self.spill_dir is not None and not os.fspath(self.spill_dir):
            raise ValueError(
                "lms: spill_dir='' names no folder; pass a folder, or None for the system's "
                "temporary folder"
            )

    @property
    def budget_bytes(self) -> int | None:
        """The device budget in bytes, or None."""
        return self.budget  # type: ignore[return-value]

    @property
    def min_offload(self) -> int:
        """The effective smallest offloaded size in bytes."""
        value = int(self.min_offload_bytes)
        return AUTO_MIN_OFFLOAD_BYTES if value == -1 else value

    @property
    def ahead(self) -> int:
        """The effective prefetch distance, counted in uses, groupby included."""
        ahead = AUTO_SWAPIN_AHEAD if self.swapin_ahead == -1 else self.swapin_ahead
        return ahead + max(self.swapin_groupby, 0)

    @property
    def sync_out(self) -> bool:
        """Whether each copy out is waited for (sync modes 1 and 3)."""
        return SyncMode(self.sync_mode).waits_out

    @property
    def sync_in(self) -> bool:
        """Whether copies in happen on demand only (sync modes 2 and 3)."""
        return SyncMode(self.sync_mode).on_demand


class LMSSettings(TypedDict, total=False):
    """`LMSConfig`'s fields as the keyword arguments `lms.LMS` takes, for type checkers: a
    misspelt setting or a value of the wrong type is an error before the code runs (each
    field's meaning is on `LMSConfig`)."""

    budget: int | str | None
    tier: Tier
    swapout_threshold: int
    swapin_ahead: int
    swapin_groupby: int
    sync_mode: SyncModes
    min_offload_bytes: int | str
    spill_dir: str | None
    spill_reserve: int | str
    host_budget: int | str | None
    free_held: bool
    slabs: bool
    cpu_resident: bool
