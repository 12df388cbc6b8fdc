"""Byte sizes: parse "10GiB" / "1.5 GB" / 1024, format them back for people, and round them up
to the host pool's buckets."""

from __future__ import annotations

import math
import re
from typing import TypeGuard

__all__ = [
    "parse_bytes",
    "parse_share",
    "is_share",
    "format_bytes",
    "format_rate",
    "check_counts",
    "bucket_bytes",
    "BUCKET_STEP",
]

_UNITS = {
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def is_share(value: object) -> TypeGuard[str]:
    """Whether ``value`` is written as a share (``"60%"``), valid or not."""
    return isinstance(value, str) and value.strip().endswith("%")


def parse_share(value: object, *, field: str = "budget") -> float | None:
    """The share of the step's peak a budget such as ``"60%"`` asks for; None for any other
    value.

    Raises:
        ValueError: a percent outside (0, 100], naming ``field``.
    """
    if not is_share(value):
        return None
    try:
        fraction = float(value.strip()[:-1]) / 100
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise ValueError(
            f"lms: {field}={value!r} is not a share of the peak; use a percent in (0, 100], "
            "e.g. '60%', or a size such as '32GiB'"
        )
    return fraction


def parse_bytes(value: int | float | str, *, field: str = "size", positive: bool = False) -> int:
    """Return a byte count from an int, a float or a string such as ``"10GiB"``: a string
    carries its unit (``"1024B"`` for bytes), since a bare number typed for a budget
    (``--budget 60``) means gigabytes or a percent far more often than bytes.

    Raises:
        ValueError: naming ``field`` when the value is negative, 0 where ``positive``, or not a
            size.
    """
    if isinstance(value, bool):
        raise ValueError(
            f"lms: {field}={value!r} is not a size; give bytes or a string like '10GiB'"
        )
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is not None and not unit:  # "60" typed for a budget: never 60 bytes meant
            number_typed = match.group(1)
            takes_share = field.lstrip("-") == "budget"
            share = " or a share of the step's peak ('60%')" if takes_share else ""
            raise ValueError(
                f"lms: {field}={value!r} has no unit; give a size with its unit "
                f"('{number_typed}GiB', '{number_typed}MiB', '{number_typed}B'){share}, or an "
                "int of bytes"
            )
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"lms: {field}={value!r} is not a size; use an int of bytes or a string like "
                "'10GiB', '512MiB' or '32GB'"
            )
        number = float(match.group(1)) * _UNITS[unit]
    else:
        raise ValueError(
            f"lms: {field}={value!r} is not a size; give bytes or a string like '10GiB'"
        )
    if not math.isfinite(number):
        raise ValueError(
            f"lms: {field}={value!r} is not a size; give a finite number of bytes or a string "
            "like '10GiB'"
        )
    if number < 0:
        raise ValueError(f"lms: {field}={value!r} must be >= 0 bytes")
    if positive and int(number) == 0:
        raise ValueError(f"lms: {field}={value!r} must be more than 0 bytes")
    return int(number)


BUCKET_STEP = 2 * 1024**2
"""Host buffers grow in powers of two up to this size, then in multiples of it."""


def bucket_bytes(nbytes: int) -> int:
    """The host pool bucket a request of ``nbytes`` is served from (`lms.runtime.pool`), which
    the simulator counts too (`lms.core.devices.DeviceSpec.host_copy_bytes`)."""
    if nbytes <= BUCKET_STEP:
        return 1 << max(nbytes - 1, 0).bit_length()
    return -(-nbytes // BUCKET_STEP) * BUCKET_STEP


def format_bytes(nbytes: float) -> str:
    """Format a byte count with a binary unit, as in ``"10.06 GiB"``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024.0:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024.0
    return f"{size:.2f} TiB"


def format_rate(per_s: float, unit: str) -> str:
    """A data rate with an SI prefix that keeps three significant figures: "25.2 Mpixels/s"."""
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_s >= 0.9995 * scale:  # what rounds to 1000 takes the next prefix
            return f"{per_s / scale:.3g} {prefix}{unit}/s"
    return f"{per_s:.3g} {unit}/s"


def check_counts(**counts: int) -> None:
    """Refuse a count below 1 (steps, sizes, repeats) with a ValueError naming it.

    Raises:
        ValueError: for the first of ``counts`` below 1, in the order given.
    """
    for name, count in counts.items():
        if count < 1:
            raise ValueError(f"lms: {name}={count} must be at least 1")
