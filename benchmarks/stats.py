"""Medians with their spread, and ratios of medians (pure)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile, ``q`` in [0, 1]; NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, extremes and count of ``xs``."""
    return {"median": quantile(xs, 0.5), "p25": quantile(xs, 0.25), "p75": quantile(xs, 0.75),
            "min": min(xs) if xs else float("nan"), "max": max(xs) if xs else float("nan"), "n": len(xs)}


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Per-round ratios a[i] / b[i] (the sides ran alternately, so round i shared its noise)."""
    return summary([ratio(x, y) for x, y in zip(a, b)])


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def fmt_spread(s: dict[str, float], digits: int = 2, scale: float = 1.0) -> str:
    """``median (min-max, n=N)``."""
    return (f"{fmt(s['median'] * scale, digits)} ({fmt(s['min'] * scale, digits)}-{fmt(s['max'] * scale, digits)}, "
            f"n={s['n']})")
