"""What ``scripts/gen_bench_docs.py`` renders with: the page machinery and one renderer a figure file.

- ``page.py``: the generated parts and quoted figures of a page, each part's provenance, and the
  checks of the figure files (``--check``).
- ``markdown.py``: figures as the docs write them: three significant figures, megabytes, tables.
- The renderers, each a figure file's dict to the lines of its part, by where they sit in a batch's
  life: ``data_path.py`` (wire, contract, long sample, proxy), ``trainer.py`` (loss, step, weights),
  ``stack.py`` (the benches that run the whole stack: pipeline, sessions).

Which part each renderer writes is ``RENDER`` in ``scripts/gen_bench_docs.py``.
"""
