"""`centerline bench <target>`: benchmarks that print one JSON object with --json."""

from __future__ import annotations

from centerline.cli import BENCHES, dispatch


def main(argv: list[str]) -> int:
    return dispatch(BENCHES, "centerline bench", argv)
