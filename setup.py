"""The one thing pyproject.toml cannot declare stably: the C candidate-row scanner.

``optional``: without a C compiler the install goes on, and router_proxy/candidate_scan.py uses its
numpy scanner, which gives the same arrays, instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("router_proxy._rowscan", ["router_proxy/_rowscan.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
