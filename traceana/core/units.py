"""Units, and how a size is written for a person: one place, so every command says the same thing the same way."""

from __future__ import annotations

# Every unit conversion reads one of these (a literal 1e6 or 2**20 elsewhere is a scale or a tuned size, not a unit).
NS_PER_US = 1_000  # Kineto's timestamps are µs; traceana's tables ns
NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000
MS_PER_S = 1_000
US_PER_S = 1_000_000
KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40
MB = 10**6  # decimal megabyte and gigabyte: bandwidths in MB/s and GB/s, as links are rated
GB = 10**9
TFLOPS = 10**12  # FLOP/s in a TFLOP/s


def bytes_text(n: float, digits: int = 1) -> str:
    """``n`` bytes in the unit that keeps the figure readable: GiB from 1 GiB up, MiB from 1 MiB, KiB below (never "0.0 GiB")."""
    if abs(n) >= GIB:
        return f"{n / GIB:,.{digits}f} GiB"
    if abs(n) >= MIB or n == 0:
        return f"{n / MIB:,.{digits}f} MiB"
    return f"{n / KIB:,.{digits}f} KiB"


def seconds_text(s: float) -> str:
    """A duration in s, ms or µs, whichever keeps three significant figures readable (never "0.00 s")."""
    if abs(s) >= 1:
        return f"{s:,.2f} s"
    if abs(s) >= 1 / MS_PER_S or s == 0:
        return f"{s * MS_PER_S:.1f} ms"
    return f"{s * US_PER_S:.1f} µs"
