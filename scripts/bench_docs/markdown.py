"""Figures as the docs write them: three significant figures, megabytes, markdown tables."""

from __future__ import annotations


def sig(x: float) -> str:
    """Three significant figures, thousands separated: 0.0661, 5.70, 36.5, 597, 1,212."""
    if x == 0:
        return "0"
    for bound, digits in ((100, 0), (10, 1), (1, 2), (0.1, 3)):
        if abs(x) >= bound:
            return f"{x:,.{digits}f}"
    return f"{x:.3g}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
