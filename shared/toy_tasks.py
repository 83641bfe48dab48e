"""Toy tasks with verifiable rewards, small enough for the default byte-level model on a CPU.

Each task maps a random problem to ``(prompt, answer)``; the policy continues the prompt with
the answer and then ``<|endoftext|>`` (token 256 of the byte model):

    reverse  "rev abc="    -> "cba"     (3-5 lowercase letters)
    copy     "copy abc="   -> "abc"
    upper    "up abc="     -> "ABC"
    add      "add 12+7="   -> "19"      (two numbers in 0..99)

Used by ``centerline dataset`` (JSONL rows for the trainer's task publisher), by the SFT warm start
(``centerline/sft.py``) and, for the built-in rewards, by the rollout worker. A prompt belongs to
the held-out split iff ``crc32(prompt) % 10 == 0``, so train and held-out never share a
prompt, whatever the seed. Rewards compare the response (the engine already cuts it at the
stop token; anything from a literal ``<|endoftext|>`` on is cut here too):

    exact   1.0 if the response equals the answer, else 0.0
    prefix  partial credit: (length of the common prefix) / max(len(answer), len(response))

    centerline dataset --task reverse --n 1000 --seed 0 --out data/reverse.jsonl [--split heldout]
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

EOS_TEXT = "<|endoftext|>"
HELDOUT_MOD = 10  # one prompt in ten is held out


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


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": _reverse,
    "copy": _copy,
    "upper": _upper,
    "add": _add,
}


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


def response_answer(response: str) -> str:
    """The response up to a literal end-of-text marker (the engine normally strips it already)."""
    cut = response.find(EOS_TEXT)
    return response if cut < 0 else response[:cut]


def exact(response: str, task) -> float:
    """1.0 if the response is exactly the answer, else 0.0. ``task`` is a ``shared.task.PromptTask``."""
    return 1.0 if response_answer(response) == task.answer else 0.0


def prefix(response: str, task) -> float:
    """Partial credit: common-prefix length over the longer of response and answer (1.0 = exact)."""
    got, want = response_answer(response), task.answer
    longest = max(len(got), len(want))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(got, want):
        if a != b:
            break
        same += 1
    return same / longest


REWARDS = {"exact": exact, "prefix": prefix}


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
            f.write(orjson.dumps(row) + b"\n")
    print(f"wrote {len(rows)} {args.split} rows of {args.task} to {args.out}")
    return 0
