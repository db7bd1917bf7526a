"""Byte sizes written for people: ``"512M"``, ``"1.5G"``, ``"64KiB"`` (binary multiples)."""
from __future__ import annotations


def parse_size(v: str | int) -> int:
    """``"1073741824"``, ``"512M"``, ``"1.5G"``, ``"64KiB"`` -> bytes (binary multiples).

    Raises:
        ValueError: not a number with an optional K/M/G/T suffix.
    """
    if isinstance(v, int):
        return v
    s = v.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(float(s))
