"""Per-step metrics: one JSON line on stdout, one line appended to ``<run_dir>/metrics.jsonl``,
the same figures as TensorBoard scalars (event files in ``<run_dir>``, so ``tensorboard --logdir
runs/`` shows each run by its id), to Weights & Biases when ``--wandb`` is ``offline`` or
``online``, and Prometheus gauges/counters at ``/metrics`` when ``--metrics-port`` is given.
A held-out evaluation (``trainer_service/heldout.py``) goes the same ways, its line to
``<run_dir>/heldout_metrics.jsonl`` instead, at the step that scheduled it (``heldout``;
``shared/heldout_record.py``).

The HTTP server is optional and can never stop training: a port that cannot be bound is
logged and the trainer goes on without it.
"""

from __future__ import annotations

import logging
import os
import sys
import tomllib
from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from shared import heldout_record
from shared.config import ConfigError
from shared.nats_auth import redact
from shared.settings import TrainerSettings
from trainer_service.step import METRICS

log = logging.getLogger("centerline.trainer.metrics")

# Step metrics exported as gauges (names as docs/design.md section 6), prefixed centerline_trainer_.
GAUGES = (
    "step",
    "version",
    "loss",
    "grad_norm",
    "step_skipped_nonfinite",  # 1: the step's loss or gradient norm was not finite, the weights unchanged
    "trained_tokens",
    "samples",
    "reward_mean",
    "staleness_mean",
    "staleness_max",
    "token_staleness_mean",
    "token_staleness_max",
    "token_stale_share",
    "token_kv_unverified_share",
    "tool_calls",  # a step of sessions: the calls parsed from their replies (docs/design.md section 12)
    "tool_call_parse_errors",  # ... and the replies whose call markup did not parse
    *METRICS,  # the loss's, named once in step.py
    "step_s",
)
# A held-out evaluation's, gauges as well: the figure of the last step evaluated, and that step
# (HELDOUT_STEP, which W&B plots the held-out figures against).
HELDOUT_STEP = "heldout_step"
HELDOUT_GAUGES = (
    HELDOUT_STEP,
    "heldout_accuracy",
    "heldout_reward",
    "heldout_rows",
    "heldout_version_min",
    "heldout_version_max",
)


def scalars(record: dict) -> dict[str, float]:
    """A step record's numbers as scalar tags: top-level numbers by name, a table of numbers
    (``gate_rejected``) as ``name/key``; booleans, strings and lists are not scalars."""
    out = {}
    for name, value in record.items():
        if isinstance(value, dict):
            out.update({f"{name}/{key}": float(v) for key, v in value.items() if _number(v)})
        elif _number(value):
            out[name] = float(value)
    return out


def complete_lines(data: bytes) -> tuple[list[bytes], int]:
    """The complete lines of ``data``, read from a JSONL file that may be growing, and the bytes
    they span. A line is complete once its newline is written: what follows the last newline is a
    line being appended, or one a crash cut short, and is left out (``len(data)`` is then larger)."""
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), end


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Metrics:
    def __init__(self, settings: TrainerSettings):
        """From the trainer's ``settings``: ``run_dir``, ``metrics_port``, ``tensorboard``, ``wandb``."""
        run_dir, port = settings.run_dir, settings.metrics_port
        self.path, self.heldout_path = run_dir / "metrics.jsonl", run_dir / heldout_record.FILE
        self.run_dir, self.tensorboard, self._tb = run_dir, settings.tensorboard, None
        self.purge_from: int | None = None  # the first step this process writes (``recover``)
        self.config = run_config(run_dir, settings)  # W&B's config and TensorBoard's hparams: what the run is
        self._wandb = (
            _wandb_run(run_dir, settings.wandb, settings.wandb_project, self.config)
            if settings.wandb != "off"
            else None
        )
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge(f"centerline_trainer_{name}", f"last step's {name}", registry=self.registry) for name in GAUGES
        }
        self.heldout_gauges = {
            name: Gauge(f"centerline_trainer_{name}", f"last held-out evaluation's {name}", registry=self.registry)
            for name in HELDOUT_GAUGES
        }
        self.accepted = Counter(
            "centerline_trainer_gate_accepted", "batches accepted by the gate", registry=self.registry
        )
        self.rejected = Counter(
            "centerline_trainer_gate_rejected", "batches dead-lettered, by rule", ["rule"], registry=self.registry
        )
        self.duplicate = Counter(
            "centerline_trainer_gate_duplicate", "redeliveries of trained batches, acked", registry=self.registry
        )
        self.dropped = Counter(
            "centerline_trainer_gate_dropped",
            "batches acked untrained, no defect, by rule (duplicate_attempt: another attempt of the task trained)",
            ["rule"],
            registry=self.registry,
        )
        self.resampled = Counter(
            "centerline_trainer_gate_resampled",
            "tasks published again as a new attempt because their batch was stale",
            registry=self.registry,
        )
        self.resample_failed = Counter(
            "centerline_trainer_gate_resample_failed",
            "stale batches nak'ed because their task could not be published again (they come back)",
            registry=self.registry,
        )
        self.weight_failures = Gauge(
            "centerline_trainer_weight_sync_failures", "engine weight updates that failed", registry=self.registry
        )
        self.weights_verified = Gauge(
            "centerline_trainer_weights_verified",
            "engines whose /weights_checker checksum proved the latest version",
            registry=self.registry,
        )
        self.weight_mismatches = Gauge(
            "centerline_trainer_weight_mismatches",
            "proofs that found an engine serving other weights than its label names",
            registry=self.registry,
        )
        self.weight_catch_ups = Gauge(
            "centerline_trainer_weight_catch_ups",
            "engines found serving an older version (restarted) and sent the latest again",
            registry=self.registry,
        )
        if port is not None:
            try:
                start_http_server(port, registry=self.registry)
            except OSError as exc:
                log.error("metrics server not started on port %d (%s); training continues without it", port, exc)

    def gate(self, counts) -> dict:
        """Gate counts of one step as flat fields, and into the Prometheus counters."""
        rejected = {key.split(":", 1)[1]: n for key, n in counts.items() if key.startswith("rejected:")}
        dropped = {key.split(":", 1)[1]: n for key, n in counts.items() if key.startswith("dropped:")}
        self.accepted.inc(counts.get("accepted", 0))
        self.duplicate.inc(counts.get("duplicate", 0))
        self.resampled.inc(counts.get("resampled", 0))
        self.resample_failed.inc(counts.get("resample_failed", 0))
        for rule, n in rejected.items():
            self.rejected.labels(rule).inc(n)
        for rule, n in dropped.items():
            self.dropped.labels(rule).inc(n)
        return {
            "gate_accepted": counts.get("accepted", 0),
            "gate_rejected": rejected,
            "gate_duplicate": counts.get("duplicate", 0),
            "gate_dropped": dropped,
            "gate_resampled": counts.get("resampled", 0),
            "gate_resample_failed": counts.get("resample_failed", 0),
            # a full store (docs/design.md section 3): dead letters nak'ed unstored, task publishes refused,
            # trained batches purged from ROLLOUTS to make room
            "gate_unstored": counts.get("rejected_unstored", 0),
            "store_full": counts.get("store_full", 0),
            "store_trimmed": counts.get("store_trimmed", 0),
        }

    def recover(self, state: dict) -> None:
        """Make ``metrics.jsonl`` agree with the checkpoint ``state`` the trainer resumes from.

        A crash can cut the last line short (it is dropped), leave lines of steps after the
        checkpoint (journalled steps, trained and logged again: their lines are dropped here),
        or come after a step's checkpoint and before its line (the line is rebuilt from the
        loss metrics the checkpoint keeps, its batches in training order from the ledger,
        marked ``"recovered": true``; gate counts and timings of that step are gone). Every
        committed step then has one line.
        """
        complete = _drop_partial_line(self.path)
        _drop_partial_line(self.heldout_path)
        _drop_partial_line(self.run_dir / heldout_record.OLD_FILE)  # a run an earlier release began
        lines = [orjson.loads(line) for line in complete]
        step = state["step"]
        later = [line["step"] for line in lines if line.get("step", 0) > step]
        if later:  # steps journalled after the checkpoint: trained again, and logged again, from it
            log.warning("metrics.jsonl: the lines of steps %s after checkpoint %d are dropped", later, step)
            kept = [raw for raw, line in zip(complete, lines) if line.get("step", 0) <= step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(raw + b"\n" for raw in kept))
            os.replace(tmp, self.path)
            lines = [line for line in lines if line.get("step", 0) <= step]
        self.purge_from = step + 1
        if step == 0 or "metrics" not in state or any(line.get("step") == step for line in lines):
            return
        batch_ids = [bid for entry in state["ledger"].values() if entry["step"] == step - 1 for bid in entry["parts"]]
        log.warning("step %d is checkpointed but has no metrics line; rebuilt from its checkpoint", step)
        self.purge_from = step
        self.step(
            {"step": step, "version": state["version"], **state["metrics"], "batch_ids": batch_ids, "recovered": True}
        )

    def step(self, record: dict) -> None:
        """Log and store one step's record (a flat dict of JSON values)."""
        line = orjson.dumps(record)
        sys.stdout.buffer.write(line + b"\n")
        sys.stdout.flush()
        with open(self.path, "ab") as fh:
            fh.write(line + b"\n")
        for name, gauge in self.gauges.items():
            if isinstance(record.get(name), (int, float)):
                gauge.set(record[name])
        values, step = scalars(record), int(record["step"])
        self._scalars(values, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def heldout(self, record: dict) -> None:
        """Log and store one held-out evaluation's record (``heldout.HeldoutRounds.figures``): its
        line of ``heldout_metrics.jsonl``, and its figures at the step that scheduled it."""
        line = orjson.dumps(record)
        sys.stdout.buffer.write(line + b"\n")
        sys.stdout.flush()
        with open(self.heldout_path, "ab") as fh:
            fh.write(line + b"\n")
        self.heldout_gauges[HELDOUT_STEP].set(record["step"])
        for name, gauge in self.heldout_gauges.items():
            if isinstance(record.get(name), (int, float)):
                gauge.set(record[name])
        values = {k: v for k, v in scalars(record).items() if k.startswith(heldout_record.PREFIX)}
        self._scalars(values, int(record["step"]))
        if self._wandb is not None:  # W&B steps only grow: held-out figures are plotted against heldout_step
            self._wandb.define_metric(f"{heldout_record.PREFIX}*", step_metric=HELDOUT_STEP)
            self._wandb.log({**values, HELDOUT_STEP: record["step"]})

    def _scalars(self, values: dict[str, float], step: int) -> None:
        if not self.tensorboard:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a run resumed after a crash drops the events its last process wrote
            # for steps it trains again, as metrics.jsonl does.
            purge = self.purge_from if self.purge_from is not None else step
            self._tb = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge)
            _write_hparams(self._tb, self.config)
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # waits for W&B's service process to have written the run's files


def _drop_partial_line(path: Path) -> list[bytes]:
    """Cut a line a crash left short off the end of the JSONL file ``path``; its complete lines."""
    data = path.read_bytes() if path.exists() else b""
    complete, end = complete_lines(data)
    if end != len(data):
        log.warning("%s ended in a partial line (%d bytes); dropped", path, len(data) - end)
        with open(path, "r+b") as fh:
            fh.truncate(end)
    return complete


def run_config(run_dir: Path, settings: TrainerSettings) -> dict[str, str | int | float | bool]:
    """The run's whole configuration, flat (``trainer.steps``, ``learning_rate``...): the
    ``config.toml`` that ``centerline up`` wrote into ``run_dir`` (every table), else the trainer's
    own settings; a list or an unset value as its JSON text."""
    path = run_dir / "config.toml"
    try:
        tables = tomllib.loads(path.read_text()) if path.is_file() else {}
    except (OSError, tomllib.TOMLDecodeError):
        tables = {}
    if not tables:
        tables = {TrainerSettings.name: settings.model_dump(mode="json")}
    out: dict[str, str | int | float | bool] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif isinstance(value, str):
            out[prefix] = redact(value) if "://" in value else value  # a URL's password stays out of the logs
        elif isinstance(value, int | float | bool):
            out[prefix] = value
        elif isinstance(value, list):
            out[prefix] = orjson.dumps([redact(v) if isinstance(v, str) else v for v in value]).decode()
        else:  # unset
            out[prefix] = orjson.dumps(value).decode()

    walk("", tables)
    return dict(sorted(out.items()))


def _write_hparams(writer, config: dict) -> None:
    """The run's configuration as TensorBoard's hparams (its HPARAMS tab), against the train reward."""
    from torch.utils.tensorboard.summary import hparams

    for summary in hparams(config, {"reward_mean": 0.0}):
        writer.file_writer.add_summary(summary)


def _wandb_run(run_dir: Path, mode: str, project: str, config: dict | None = None):
    """A W&B run named by the run directory, resumed when it exists (a restarted trainer)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"--wandb {mode} needs the wandb package, which is not installed: pip install 'centerline[wandb]' "
            "(or --wandb off)"
        ) from None
    return wandb.init(
        project=project,
        name=run_dir.name,
        id=run_dir.name,
        dir=str(run_dir),
        mode=mode,
        resume="allow",
        config=config or {},
    )
