"""The one thing pyproject.toml cannot declare stably: the C candidate-row scanner.

``optional``: without a C compiler the install goes on, and shared/candidate_scan.py uses its
numpy scanner, which gives the same arrays, instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shared._rowscan", ["shared/_rowscan.c"], optional=True, extra_compile_args=["-O2"])])
