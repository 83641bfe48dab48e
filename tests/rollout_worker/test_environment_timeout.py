"""The worker's deadline for a task's environment: the setting where given, else its default from
the turn timeout and the session token budget (shared/worker_settings.py, docs/design.md section 12)."""

from __future__ import annotations

import argparse

from shared.config import Config, add_arguments, parse_args
from shared.settings import WorkerSettings


def test_the_default_deadline_is_the_turn_timeout_times_the_budgets_longest_turns_at_most_30_minutes():
    cfg = Config(rollout_max_new_tokens=16, rollout_session_max_tokens=1024)
    assert WorkerSettings().environment_deadline(cfg) == 1800.0  # 600 s x 64 turns, bounded to 30 minutes
    assert WorkerSettings(request_timeout=20).environment_deadline(cfg) == 20.0 * 64
    assert (
        WorkerSettings(request_timeout=3).environment_deadline(
            Config(rollout_max_new_tokens=16, rollout_session_max_tokens=40)
        )
        == 3.0 * 3
    )  # ceil(40 / 16): a last, shorter turn counts whole


def test_the_flag_sets_the_deadline_whatever_the_budget():
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings)
    argv = ["--environment-timeout", "2.5", "--request-timeout", "3", "--rollout-session-max-tokens", "4096"]
    _, cfg, settings = parse_args(parser, argv, section=WorkerSettings)
    assert (settings.environment_timeout, settings.environment_deadline(cfg)) == (2.5, 2.5)
