"""`centerline experiment`'s wing: experiments made of `centerline up` runs, and their statistics.

- ``staleness.py``: the command (``centerline experiment staleness``): the grid of methods,
  staleness and seeds, each run a variant of one run spec, run in sequence.
- ``summary.py``: each run's numbers and each setting's over its seeds, paired differences too.
- ``interval.py``: the Student-t interval of a mean over a few seeds.
- ``report.py``: the comparison page, its plots, ``summary.json`` and ``results.json``.
"""
