"""The self-contained HTML pages and PNG plots centerline writes: a run's report (``report.py``)
and an experiment's comparison (``centerline/experiments/report.py``).

A page is one file: plots inlined as base64 PNG, no script, no network. Each plot is also written
as ``plots/<name>.png`` beside the page. Every text put on a page is HTML-escaped here.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files, no display); imported when a page is drawn,
    so that the commands that write none never pay for matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig) -> bytes:
    """``fig`` as PNG bytes, 100 dpi, cropped to its content."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def write_plots(out: Path, plots: dict[str, tuple[str, bytes]]) -> None:
    """Each plot of ``plots`` (name -> (title, PNG)) as ``out/plots/<name>.png``."""
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for name, (_, png) in plots.items():
        (out / "plots" / f"{name}.png").write_bytes(png)


def image(title: str, png: bytes) -> str:
    """An ``<img>`` holding ``png`` itself, ``title`` its alternative text."""
    return f"<img alt='{html.escape(title)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"


def row(cells: Iterable[str], cell: str = "td") -> str:
    """A table row of ``cells`` (``cell``: ``td``, or ``th`` for a header)."""
    return "<tr>" + "".join(f"<{cell}>{html.escape(c)}</{cell}>" for c in cells) + "</tr>"


def page(title: str, style: str, body: list[str]) -> str:
    """The HTML document titled ``title``, styled by the CSS ``style``, with ``body``'s parts (HTML)
    one per line."""
    head = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
    return "\n".join([head, f"<style>{style}</style></head><body>", *body, "</body></html>"])
