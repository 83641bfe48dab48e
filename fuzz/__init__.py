"""Fuzz harnesses (atheris/libFuzzer), run from the repository root: see README.md, "Fuzzing"."""
