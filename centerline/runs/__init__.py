"""Tools for what a run leaves behind: its messages, metrics and weight versions.

- ``record.py``, ``replay.py``: save NATS messages to a record file, replay one into NATS or into
  offline trainer steps (``centerline record``, ``centerline replay``).
- ``report.py``: a run's HTML report and plots (``centerline report``); ``page.py``, the pages and
  plots it and ``centerline experiment`` write.
- ``run_figures.py``: a run's figures as data, stamped with the command, commit and machine; the
  benches stamp theirs with it too.
- ``teacher_force.py``: a finished run's token labels checked against the weights they name
  (``centerline teacher-force``).
"""
