"""Holds the import-only `sgl_kernel` stand-in (see sgl_kernel/__init__.py); `centerline sglang --device cpu`
puts this directory on the SGLang server's PYTHONPATH."""
