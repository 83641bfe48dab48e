"""The held-out record (docs/design.md section 9): one line per held-out evaluation round, which
the trainer appends to ``RUN_DIR/heldout_metrics.jsonl`` (``trainer_service/heldout.py``) and
``centerline up``, ``centerline report``, a run's figures, an experiment's summary and ``bench
pipeline`` read back: ``{step, heldout_accuracy | heldout_reward, heldout_rows, version,
heldout_version_min, heldout_version_max, heldout_s}``. ``heldout_accuracy`` where every row is
single-turn and scored by exact match, else ``heldout_reward``, the mean reward of one sample per row.
(``RUN_DIR/heldout.jsonl`` is another file: the held-out rows ``up`` writes.)

Runs of earlier releases, where held-out evaluation had two names, wrote ``RUN_DIR/eval.jsonl`` with
the same keys spelled ``eval_*``: readers read that file too, before this one (a run resumed by this
release has both), its keys spelled as here.
"""

from __future__ import annotations

FILE = "heldout_metrics.jsonl"
OLD_FILE = "eval.jsonl"  # read, never written: a run of an earlier release
PREFIX = "heldout_"  # every figure of the record but step and version; eval_ in OLD_FILE
ACCURACY, REWARD = f"{PREFIX}accuracy", f"{PREFIX}reward"  # the figure: exact-match accuracy, or mean reward
