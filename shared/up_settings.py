"""``centerline up``'s settings and ``centerline replay``'s (tables ``[up]``, ``[replay]``): the
launcher's own, beside the services' (``centerline/up/run_spec.py`` composes a run of them)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from shared.rewards import REWARDS
from shared.settings_base import CommandSettings, refuse_if
from shared.toy_tasks import ENVIRONMENTS


def _reward_component(spec: str) -> bool:
    """Whether ``spec`` is a reward component: a built-in or module:function, optionally ``=weight``."""
    ref, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "1")
    try:
        finite = math.isfinite(float(weight))
    except ValueError:
        return False
    module, colon, function = ref.partition(":")
    return finite and (ref in REWARDS or bool(colon and module and function))


class UpSettings(CommandSettings):
    """``centerline up``: the whole system on one machine (centerline/up/launcher.py). What is ``up``'s own:
    the processes it starts, the task it prepares; the trainer's steps and held-out schedule are the
    trainer's settings, which ``up`` takes as flags too (below)."""

    name: ClassVar[str] = "up"
    command: ClassVar[str] = "centerline up"
    renamed: ClassVar[dict[str, str]] = {"eval_dataset": "heldout_dataset", "eval_prompts": "heldout_prompts"}

    model: Path | None = Field(
        None,
        description="Your own causal LM, an HF directory that SGLang and transformers load (`centerline make-model "
        "smollm2 --out DIR` makes one); unset: the toy model, made for --task by init-model --sft.",
    )
    dataset: Path | None = Field(
        None,
        description="Your own dataset: a JSONL file, a parquet/arrow/CSV/JSON file or a datasets save_to_disk "
        'directory (read with the datasets library), rows {"prompt" or "messages", "answer", optional "meta": {...}, '
        'optional "split": "train" | "heldout"} (centerline/up/user_task.py); or reasoning-gym:NAME, a task of that '
        "library generated (--dataset-size, --heldout-prompts, --seed) and scored by its own score_answer "
        "(centerline/up/task_library.py); unset: the toy task --task.",
    )
    heldout_dataset: Path | None = Field(
        None,
        description="Held-out rows (same format, every row used) for --dataset; unset: the rows --dataset marks "
        '"split": "heldout" (or "eval"), else none. The held-out figure is the mean reward of one sample per row.',
    )
    dataset_prompt_key: str = Field(
        "prompt", min_length=1, description="The column of --dataset (and --heldout-dataset) holding the prompt text."
    )
    dataset_answer_key: str = Field(
        "answer", min_length=1, description="The column holding the answer, task.answer of the reward function."
    )
    dataset_messages_key: str = Field(
        "messages",
        min_length=1,
        description="The column holding a chat prompt (a list of {role, content}, the last the user's), rendered by "
        "the model's chat template; a row has this or the prompt column.",
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Apply the model's chat template to each prompt as one user message with the generation "
        "prompt. auto: on for a --model whose tokenizer has one, off for the toy model.",
    )
    task: str = Field(
        "upper",
        description="Toy task (centerline/toy/dataset.py: upper, copy, reverse, add; chain, multi-turn, runs as "
        "sessions of the environment chain), when --dataset is unset.",
    )
    sft_steps: int = Field(
        0, ge=0, description="Warm-start steps of the model (0 = the task's default in centerline/toy/sft.py)."
    )
    reward: list[str] = Field(
        ["exact"],
        description="Training reward: a built-in (exact, prefix) or module:function, importable from the directory "
        "up runs in, called as reward(response_text, task) -> float (or async def); several weighted components: "
        "--reward m:f=1.0 --reward m:g=0.5 (in the TOML file a list, or a table [up.reward] of function = weight), "
        "the reward their weighted sum, each logged per step as reward/<function>. The toy task's held-out accuracy "
        "is always exact match.",
    )
    environment: str = Field(
        "",
        description="Make every task a multi-turn session run by this environment: a built-in (chain) or "
        "module:function, importable from the directory up runs in, `async def environment(client, task) -> float` "
        "(client: an openai.AsyncOpenAI on the task's session). With --dataset, the default of rows that name none "
        "(a row's own environment key wins); unset: the toy task's own (chain for --task chain), else none.",
    )
    workers: int = Field(2, ge=1, description="Rollout worker processes.")
    engines: int = Field(1, ge=1, description="SGLang servers behind the router.")
    nats_nodes: int = Field(
        1,
        ge=1,
        description="NATS servers: 1, or a JetStream cluster of this many nodes on loopback, whose streams get "
        "min(3, nodes) replicas unless nats_stream_replicas says otherwise.",
    )
    trainer_ranks: int = Field(2, ge=1, description="Torchrun processes of the trainer.")
    dataset_size: int = Field(
        2000,
        ge=1,
        description="Training prompts of the toy task, or of a task library's (--dataset reasoning-gym:NAME).",
    )
    heldout_prompts: int = Field(
        200, ge=1, description="Held-out prompts per evaluation, of the toy task or a task library's task."
    )
    model_dir: Path = Field(Path("models"), description="Cache of init-model outputs.")
    run_dir: Path | None = Field(None, description="Run directory; unset: runs/<date-time>.")
    startup_timeout: float = Field(300.0, gt=0, description="Seconds for each service to become ready.")
    sglang_args: str = Field(
        "", description="Extra flags for every SGLang server, one string: --sglang-args=--enable-metrics."
    )
    engine_device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="Where the SGLang servers run: cpu (the CPU recipe of centerline/sglang.py) or cuda (the GPU; "
        "give them a share of its memory with --sglang-args=--mem-fraction-static=X when the trainer shares it).",
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_forms(cls, value):
        """One name (a TOML string, an old run's config), or a TOML table of ``function = weight``."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [f"{ref}={weight}" for ref, weight in value.items()]
        return value

    @model_validator(mode="after")
    def _runnable(self) -> UpSettings:
        env_module, env_sep, env_function = self.environment.partition(":")
        bad_reward = next((r for r in self.reward if not _reward_component(r)), None)
        refuse_if(
            bad_reward is not None or not self.reward,
            "reward",
            bad_reward if self.reward else "(none)",
            f"a built-in ({', '.join(sorted(REWARDS))}) or module:function, with =weight where several are given "
            "(--reward m:f=1.0 --reward m:g=0.5)",
        )
        refuse_if(
            bool(self.environment)
            and self.environment not in ENVIRONMENTS
            and not (env_sep and env_module and env_function),
            "environment",
            self.environment,
            f"a built-in ({', '.join(sorted(ENVIRONMENTS))}) or module:function, e.g. mymodule:play "
            "for `async def play(client, task)` in mymodule.py",
        )
        refuse_if(
            self.heldout_dataset is not None and self.dataset is None,
            "heldout_dataset",
            self.heldout_dataset,
            "held-out rows of your own dataset need --dataset too",
        )
        return self


class ReplaySettings(CommandSettings):
    """``centerline replay``: a record file back into NATS or into the trainer's steps (centerline/runs/replay.py).
    With ``--train`` it also restores every setting of the run's ``[trainer]`` table (but its model, run
    directory and metrics port)."""

    name: ClassVar[str] = "replay"
    command: ClassVar[str] = "centerline replay"

    subject: str | None = Field(None, description="--to: publish here instead of each message's recorded subject.")
    checkpoint: Path | None = Field(None, description="--train: checkpoint directory to start from (step-NNNNNN).")
    run_dir: Path | None = Field(None, description="--train: output directory; unset: FILE with suffix .replay.")
    steps_from: Path | None = Field(
        None,
        description="--train: the original metrics.jsonl; batches are grouped into steps as it lists them. "
        "Unset: the one in the checkpoint's run directory, unless --batches-per-step is given.",
    )
    batches_per_step: int = Field(1, ge=1, description="--train without --steps-from: accepted batches per step.")
    steps: int | None = Field(None, ge=0, description="--train: replay at most this many steps; unset: all.")

    @model_validator(mode="after")
    def _one_grouping(self) -> ReplaySettings:
        refuse_if(
            self.steps_from is not None and self.batches_per_step != 1,
            "batches_per_step",
            self.batches_per_step,
            "--steps-from groups the batches as the original run did; drop --batches-per-step",
        )
        return self
