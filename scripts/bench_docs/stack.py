"""The renderers of the benches that run the whole stack: ``bench pipeline`` (a run's modes side by
side) and ``bench sessions`` (session turns beside single requests)."""

from __future__ import annotations

from scripts.bench_docs.markdown import table


def pipeline(fig: dict) -> list[str]:
    header = [
        "mode",
        "samples/s (vs alone)",
        "weights_s mean (max)",
        "engine duty cycle",
        "trainer duty cycle",
        "gather s/step",
        "staleness per trained token: mean, max, share > 1",
        "labels untrue: teacher-forced (tokens)",
    ]
    rows = [
        [
            f"{mode} (`{m['weight_update']}`)",
            f"{m['pipeline_samples_per_s']:.2f} ({m['samples_per_s_ratio']:.3f}x)",
            f"{m['weights_s_mean']:.3f} ({m['weights_s_max']:.3f})",
            f"{m['duty_cycle']:.3f}",
            f"{m['trainer_duty_cycle']:.3f}",
            f"{m['pipeline_gather_s_mean']:.3f}",
            f"{m['token_staleness_mean']:.3g}, {m['token_staleness_max']}, {m['token_stale_share'] * 100:.2g} %",
            labels(m),
        ]
        for mode, m in fig["modes"].items()
    ]
    return [
        f"{fig['train_seconds']:g} s of training per mode, {fig['workers']} workers, {fig['trainer_ranks']} trainer "
        f"ranks, {fig['prompts_per_step']} prompts x {fig['rollout_n']} samples a step, K = "
        f"{fig['rollout_top_logprobs_num']}; SGLang alone at the same concurrency, in the same run: "
        f"{fig['sglang_alone_samples_per_s']:.2f} samples/s.",
        "",
        *table(header, rows),
    ]


def labels(m: dict) -> str:
    """The share of a mode's teacher-forced tokens whose recorded log-prob is not their label's
    (``bench pipeline --teacher-force``), or that it was not checked."""
    if "label_mismatch_share" not in m:
        return "not checked"
    return f"{m['label_mismatch_share'] * 100:.3g} % ({m['label_checked_tokens']:,})"


def pipeline_sessions(fig: dict) -> list[str]:
    """``pipeline`` of a run of sessions (``--task chain``): SGLang alone then got the sessions'
    first turns as single requests, which is no ceiling for sessions; it is named, not compared."""
    table_lines = pipeline(fig)[2:]
    return [
        f"Task `{fig['task']}` (sessions of 2-4 turns), {fig['train_seconds']:g} s of training per mode, "
        f"{fig['workers']} workers, {fig['prompts_per_step']} prompts x {fig['rollout_n']} sessions a step, K = "
        f"{fig['rollout_top_logprobs_num']}. The ratio to SGLang alone is to single first-turn requests "
        f"({fig['sglang_alone_samples_per_s']:.1f} samples/s), not a ceiling for sessions: read the modes "
        "against each other.",
        "",
        *table_lines,
    ]


def pipeline_before_in_flight(fig: dict) -> list[str]:
    modes = fig["modes"]
    on, dr = modes["on-policy"], modes["drain"]
    alone = f"{fig['sglang_alone_samples_per_s']:.1f} samples/s at {fig['concurrent_requests']} requests"

    def row(name, cell):
        return [name, cell(on), cell(dr)]

    rows = [
        row(f"steps in {fig['train_seconds']:g} s", lambda m: str(m["steps_done"])),
        row(
            "trained samples/s (tokens/s)",
            lambda m: (
                f"{m['pipeline_samples_per_s']:.1f} ({m['pipeline_tokens_per_s']:,.0f})"
                + ("" if m is on else f", {m['pipeline_samples_per_s'] / on['pipeline_samples_per_s']:.2f}x")
            ),
        ),
        row(f"vs SGLang alone ({alone})", lambda m: f"{m['samples_per_s_ratio']:.2f}x"),
        row(
            "step: waiting for batches / the rest",
            lambda m: (
                f"{m['pipeline_gather_s_mean']:.3f} s / {m['pipeline_step_s_mean'] - m['pipeline_gather_s_mean']:.3f} s"
            ),
        ),
        row(
            "step: training / checkpoint / weights into SGLang",
            lambda m: f"{m['pipeline_train_s_mean']:.3f} / {m['checkpoint_s_mean']:.3f} / {m['weights_s_mean']:.3f} s",
        ),
        row(
            "SGLang duty cycle (share of time it had work)",
            lambda m: (
                f"{m['duty_cycle']:.3f}" + ("" if m is on else f" (SGLang alone: {fig['sglang_alone_duty_cycle']:.3f})")
            ),
        ),
        row("trainer duty cycle (share of step time not waiting)", lambda m: f"{m['trainer_duty_cycle']:.3f}"),
        row("held-out accuracy before -> after", lambda m: f"{m['accuracy_before']:.3f} -> {m['accuracy_after']:.3f}"),
        row("staleness max", lambda m: str(m["staleness_max"])),
    ]
    lines = table(["", "on-policy", "async, draining updates"], rows)
    one = fig.get("one_forward_per_sample")
    if one:
        lines += [
            "",
            "With one forward per sample (before `--micro-batch-tokens`), the same bench measured a step's part "
            f"after the wait at {one['on-policy']['step_after_wait_s']:.2f} s on-policy and "
            f"{one['drain']['step_after_wait_s']:.2f} s async: {one['on-policy']['pipeline_samples_per_s']:.1f} and "
            f"{one['drain']['pipeline_samples_per_s']:.1f} samples/s, SGLang duty cycles "
            f"{one['on-policy']['duty_cycle']:.3f} and {one['drain']['duty_cycle']:.3f}.",
        ]
    return lines


WORKER_STAGES = ("endpoint", "history", "render", "tokenize", "reply")  # bench sessions' stages_ms in the worker


def sessions(fig: dict) -> list[str]:
    policies, single = fig["policies"], fig["single"]
    names = {"manual": "manual (affinity, default)"}

    def row(name, cell, single_cell=""):
        return [name, *(cell(p) for p in policies.values()), single_cell]

    rows = [
        row("turn / request, mean", lambda p: f"{p['turn_ms_mean']:.1f} ms", f"{single['request_ms_mean']:.1f} ms"),
        row(
            "later turns (2+), mean",
            lambda p: f"{p['later_turn_ms_mean']:.1f} ms" if "later_turn_ms_mean" in p else "",
        ),
        row("overhead per turn vs single", lambda p: f"{p['overhead_ms_per_turn']:.1f} ms"),
        *(
            [
                row(
                    "of a turn, the worker's: OpenAI client / endpoint to reply",
                    lambda p: (
                        f"{p['stages_ms']['client']:.1f} / {sum(p['stages_ms'][k] for k in WORKER_STAGES):.1f} ms"
                    ),
                )
            ]
            if all("stages_ms" in p for p in policies.values())
            else []
        ),
        row(
            "sampled tokens/s (ratio to single)",
            lambda p: f"{p['tokens_per_s']:.1f} ({p['tokens_per_s_ratio']:.2f}x)",
            f"{single['tokens_per_s']:.1f}",
        ),
        row(
            "prefix cache, turns 2+: of the prompt / of the history",
            lambda p: f"{p['cache_share_later_turns']:.2f} / {p['history_cache_share_later_turns']:.3g}",
            str(single["cached_tokens"]),
        ),
        row(
            "requests per engine",
            lambda p: " / ".join(map(str, p["requests_per_engine"])),
            " / ".join(map(str, single["requests_per_engine"])),
        ),
    ]
    header = ["", *(names.get(name, name) for name in policies), "single requests"]
    return [
        f"{fig['engines']} engines, {fig['sessions']} sessions x {fig['turns']} turns "
        f"({fig['user_tokens']}-letter user messages, `max_tokens` {fig['max_tokens']}, "
        f"{fig['concurrency']} sessions at a time, K = {fig['k']}):",
        "",
        *table(header, rows),
    ]
