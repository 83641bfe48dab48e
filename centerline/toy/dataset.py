"""`centerline dataset`: the toy tasks' problems, small enough for the default byte-level model
on a CPU, and deterministic JSONL datasets of them (rows for the trainer's task publisher).

Each task maps a random problem to ``(prompt, answer)``; the rewards and the multi-turn
environments that judge the answers are the worker's (``shared/rewards.py``, ``shared/toy_tasks.py``):

    reverse  "rev abc="    -> "cba"     (3-5 lowercase letters)
    copy     "copy abc="   -> "abc"
    upper    "up abc="     -> "ABC"
    add      "add 12+7="   -> "19"      (two numbers in 0..99)
    chain    "3+4 +5 +2"   -> "7 2 4"   (a running sum's last digit over 2-4 chat turns: environment ``chain``)
    calc     "347+589="    -> "936"     (two numbers in 0..999, summed by calling a tool: environment ``calc``)

``chain``'s numbers are small (0-5, then 1-5) and its answers digits, not sums: every step is
then one of two small digit tables, which the default model learns (with 0-9 and two-digit
sums, the SFT model answered 6 later steps in 76 right and RL did not move it).

Used by ``centerline dataset``, by ``centerline up`` (its held-out prompts) and by the SFT warm
start (``centerline/toy/sft.py``). A prompt belongs to the held-out split iff
``crc32(prompt) % 10 == 0``, so train and held-out never share a prompt, whatever the seed.

    centerline dataset --task reverse --n 1000 --seed 0 --out data/reverse.jsonl [--split heldout]
    centerline dataset --task chain --environment chain --n 1000 --out data/chain.jsonl
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import orjson

from shared.toy_tasks import CALC_MAX_TOKENS

HELDOUT_MOD = 10  # one prompt in ten is held out
CHAIN_MAX = 5  # chain's numbers: 0..5 first, then 1..5 (tables of 36 and 50 digit sums)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"rev {w}=", w[::-1]


def _copy(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"copy {w}=", w


def _upper(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"up {w}=", w.upper()


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add {a}+{b}=", str(a + b)


def _chain(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, CHAIN_MAX), rng.randint(0, CHAIN_MAX)
    adds = [rng.randint(1, CHAIN_MAX) for _ in range(rng.randint(1, 3))]
    sums = [(a + b) % 10]
    for d in adds:
        sums.append((sums[-1] + d) % 10)
    return " ".join([f"{a}+{b}", *(f"+{d}" for d in adds)]), " ".join(map(str, sums))


def _calc(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return f"{a}+{b}=", str(a + b)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": _reverse,
    "copy": _copy,
    "upper": _upper,
    "add": _add,
    "chain": _chain,
    "calc": _calc,
}
CHAT_TASKS = {"chain": "chain", "calc": "calc"}  # a multi-turn task and the built-in environment that runs it
# Shared settings a toy task needs over `up`'s defaults: a call to calc's tool is 76 tokens, past
# `up`'s 8 new tokens per turn.
TASK_DEFAULTS = {"calc": {"rollout_max_new_tokens": CALC_MAX_TOKENS}}


def is_heldout(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELDOUT_MOD == 0


def examples(task: str, n: int, seed: int, split: str = "train") -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs of ``task`` from ``split`` ("train" | "heldout"); a pure function of its
    arguments."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; choose train or heldout")
    make, rng, want, out = TASKS[task], random.Random(f"{task}/{seed}"), split == "heldout", []
    while len(out) < n:
        prompt, answer = make(rng)
        if is_heldout(prompt) == want:
            out.append((prompt, answer))
    return out


def main(argv: list[str]) -> int:
    """`centerline dataset`: write a deterministic JSONL dataset of a toy task, one prompt per line."""
    parser = argparse.ArgumentParser(prog="centerline dataset", description=main.__doc__)
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--n", type=int, required=True, help="rows to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--split", choices=("train", "heldout"), default="train", help="heldout: prompts with crc32 %% 10 == 0"
    )
    parser.add_argument(
        "--reward", default="exact", help="reward function named in each row: exact, prefix or module:function"
    )
    parser.add_argument(
        "--environment",
        default="",
        help="environment named in each row (multi-turn sessions): chain or module:function",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    args = parser.parse_args(argv)
    if args.n < 0:
        print("centerline dataset: --n must be >= 0", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = examples(args.task, args.n, args.seed, args.split)
    with open(args.out, "wb") as f:
        for i, (prompt, answer) in enumerate(rows):
            row = {
                "id": f"{args.task}/{args.split}/{args.seed}/{i}",
                "prompt": prompt,
                "answer": answer,
                "reward": args.reward,
                "task": args.task,
                "split": args.split,
            }
            if args.environment:
                row["environment"] = args.environment
            f.write(orjson.dumps(row) + b"\n")
    print(f"wrote {len(rows)} {args.split} rows of {args.task} to {args.out}")
    return 0
