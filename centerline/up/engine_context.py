"""How long a sequence a ``centerline up`` run's SGLang servers take: one session of the whole token
budget (``--rollout-session-max-tokens``), checked and sized before anything starts.

SGLang refuses a request whose input reaches ``min(context length, KV pool) - 6`` tokens, and one whose
input and ``max_new_tokens`` pass the context length (its scheduler and tokenizer manager), so a
session's last turns would be refused by the engine rather than ended by the session's own budget
(docs/extending.md, An environment). Hence, for ``need = budget + 6`` tokens:

- the toy model (made by ``init-model``, rotary positions: no weight depends on their number) is
  served with ``max_position_embeddings`` raised to ``need`` where its own is smaller;
- a ``--model`` of yours whose context (``--context-length`` in ``--sglang-args``, else its
  config.json's ``max_position_embeddings``) is smaller is refused, naming the flag, both numbers and
  the fix: its positions beyond what it was trained on are not ours to stretch;
- on the CPU, whose recipe holds 2,048 tokens of KV cache (``centerline/sglang.py``), the pool is
  raised to ``need``, unless ``--sglang-args`` sets ``--max-total-tokens`` (then it must hold ``need``).
"""

from __future__ import annotations

import json
from pathlib import Path

from centerline.sglang import CPU_FLAGS
from centerline.up.user_task import UserTaskError

SGLANG_MARGIN = 6  # tokens SGLang keeps back from the shorter of the context and the KV pool
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
CPU_KV_TOKENS = int(CPU_FLAGS[CPU_FLAGS.index("--max-total-tokens") + 1])


def needed_tokens(budget: int) -> int:
    """The context and KV pool one session of ``budget`` tokens needs in SGLang."""
    return budget + SGLANG_MARGIN


def model_positions(model: Path) -> int | None:
    """The positions the model's config.json declares (its text model's, for a multimodal one), or
    None where it has no config.json or names none."""
    try:
        config = json.loads((model / "config.json").read_text())
    except FileNotFoundError:
        return None
    for table in (config, config.get("text_config") or {}):
        for key in POSITION_KEYS:
            if isinstance(table.get(key), int):
                return table[key]
    return None


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an SGLang command line (``--flag V`` or ``--flag=V``), the last one given."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def engine_flags(model: Path, toy: bool, budget: int, sglang_args: list[str], device: str) -> list[str]:
    """The SGLang flags, before ``--sglang-args``, that let one session of ``budget`` tokens through
    the engine serving ``model`` (``toy``: made by init-model) on ``device``; raises ``UserTaskError``
    naming the flag, the numbers and the fix where a setting of yours cannot hold it."""
    need, flags = needed_tokens(budget), []
    given = flag_value(sglang_args, "--context-length")
    if given is not None:
        if int(given) < need:
            raise UserTaskError(
                f"--sglang-args --context-length {given} is shorter than a session of --rollout-session-max-tokens "
                f"{budget} (SGLang needs {need}); raise it to {need}, or lower --rollout-session-max-tokens to "
                f"{int(given) - SGLANG_MARGIN}"
            )
    else:
        positions = model_positions(model)
        if positions is not None and positions < need:
            if not toy:
                raise UserTaskError(
                    f"--rollout-session-max-tokens {budget}: the model {model} holds {positions} positions "
                    f"(max_position_embeddings in its config.json) and SGLang needs {need} for a session of that "
                    f"budget; lower --rollout-session-max-tokens to {positions - SGLANG_MARGIN}, or give a model "
                    "with a longer context (or --sglang-args='--context-length N' with SGLang's "
                    "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, if its positions extend)"
                )
            flags += ["--json-model-override-args", json.dumps({"max_position_embeddings": need})]
    if device == "cpu":
        pool = flag_value(sglang_args, "--max-total-tokens")
        if pool is None and need > CPU_KV_TOKENS:
            flags += ["--max-total-tokens", str(need)]
        elif pool is not None and int(pool) < need:
            raise UserTaskError(
                f"--sglang-args --max-total-tokens {pool} holds less than one session of "
                f"--rollout-session-max-tokens {budget} (SGLang needs {need}); raise it to {need} or more"
            )
    return flags


def check_weight_transport(transport: str, engine_device: str, trainer_on_cuda: bool) -> None:
    """Raises ``UserTaskError`` where ``--weight-transport distributed`` cannot work in ``up``'s
    placement: with the trainer on CUDA the group is NCCL (docs/design.md section 8, the GPU form),
    and ``up`` serves every engine on GPU 0, where trainer rank 0 is (NCCL refuses two ranks on
    one device), or on the CPU, which NCCL does not reach."""
    if transport != "distributed" or not trainer_on_cuda:
        return
    where = "on GPU 0 beside trainer rank 0" if engine_device.startswith("cuda") else "on the CPU"
    raise UserTaskError(
        f"--weight-transport distributed: the trainer broadcasts over NCCL on CUDA, and up serves its "
        f"engines {where} (--engine-device {engine_device}), which an NCCL group cannot join; use "
        "--weight-transport disk, the default (docs/design.md section 8, the GPU form)"
    )
