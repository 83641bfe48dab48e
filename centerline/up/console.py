"""What ``centerline up`` shows as it runs: a live status line per training step on a terminal,
one JSON line per step and per held-out evaluation otherwise (``Progress``), and its own messages
on stderr (``log``)."""

from __future__ import annotations

import sys

import orjson

from shared.heldout_record import ACCURACY, REWARD


class Progress:
    """A live line on a terminal, one JSON line per record otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout  # looked up now, so contextlib.redirect_stdout applies
        self.tty = self.stream.isatty()

    def show(self, record: dict, steps: int) -> None:
        if not self.tty:
            self.stream.write(orjson.dumps(record).decode() + "\n")
        elif ACCURACY in record and "loss" not in record:
            self.stream.write(f"\r\x1b[K  held-out accuracy at step {record['step']}: {record[ACCURACY]:.3f}\n")
        elif REWARD in record and "loss" not in record:
            self.stream.write(f"\r\x1b[K  held-out mean reward at step {record['step']}: {record[REWARD]:.3f}\n")
        else:
            done = record.get("step", 0)
            bar = "#" * int(30 * done / max(steps, 1))
            rejected = sum((record.get("gate_rejected") or {}).values())
            self.stream.write(
                f"\r\x1b[K[{bar:<30}] step {done}/{steps}  reward {record.get('reward_mean', 0):.3f}  "
                f"sc_corr {record.get('sc_correction', 0):.4f}  sc_l1 {record.get('sc_residual_l1', 0):.4f}  "
                f"head P/Q {record.get('sc_train_head_mass', 0):.3f}/"
                f"{record.get('sc_rollout_head_mass', 0):.3f}  kl {record.get('train_rollout_kl', 0):.2e}  "
                f"stale {record.get('staleness_mean', 0):.1f}  gate +{record.get('gate_accepted', 0)}/-{rejected}"
            )
        self.stream.flush()


def log(message: str) -> None:
    """One line of ``centerline up``'s own on stderr."""
    print(f"centerline up: {message}", file=sys.stderr, flush=True)
