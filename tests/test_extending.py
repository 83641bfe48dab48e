"""docs/extending.md's examples are real: each snippet is quoted from its file in examples/, and each
file runs here as the page says (the dataset written and read as `up` reads it, the rewards scored
as a worker scores them, the command lines parsed and checked as `up` checks them). The agent and
the task library run end to end in tests/rollout_worker/test_agents_sdk.py and
tests/centerline/up/test_task_library.py."""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import sys

from centerline.up.run_spec import parse
from centerline.up.user_task import check_reward, load_task
from rollout_worker.rewards import Scorer
from shared.task import PromptTask
from tests.processes import ENV, REPO

PAGE = (REPO / "docs" / "extending.md").read_text()
EXAMPLES = REPO / "examples"


def blocks(kind: str) -> list[str]:
    """The page's fenced blocks of language ``kind`` ("" for a plain block), each as its text."""
    found, current, language = [], None, None
    for line in PAGE.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language == kind:
                    found.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return found


def test_every_python_snippet_is_quoted_from_an_example_file():
    files = {p.name: p.read_text() for p in EXAMPLES.glob("*.py")}
    for snippet in blocks("python"):
        assert any(snippet in text for text in files.values()), snippet[:80]
    components = files["reward_components.py"].split("\n\n\n", 1)[1]
    assert components in PAGE  # the whole file, but its docstring


def test_the_chat_dataset_example_writes_rows_up_reads_and_its_rewards_score_them(tmp_path):
    shutil.copy(EXAMPLES / "chat_dataset.py", tmp_path)
    run = subprocess.run([sys.executable, "chat_dataset.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"wrote {tmp_path / 'chat_capitals.parquet'}: 3 rows\n"
    task = load_task(tmp_path / "chat_capitals.parquet", None)
    assert [(r.prompt, r.answer, len(r.messages)) for r in task.train] == [
        ("Capital of France?", "Paris", 2),
        ("And of Italy?", "Rome", 4),
    ]
    assert [(r.prompt, r.answer) for r in task.heldout] == [("Capital of Germany?", "Berlin")]
    (command,) = [line for b in blocks("") for line in b.replace("\\\n", " ").splitlines() if "chat_capitals" in line]
    argv = shlex.split(command)
    assert argv[:2] == ["centerline", "up"]
    spec = parse(argv[2:])
    reward = check_reward(spec.up.reward)
    assert reward == "examples.reward_components:judged=1.0,examples.reward_components:brevity=0.5"
    prompt = PromptTask("t/0/0", "g", "And of Italy?", "Rome", reward, 3, 0)
    scores = asyncio.run(Scorer(threads=2).score(prompt, ["Rome", "rome is the capital of Italy", "Paris"]))
    assert scores.components == {"judged": [1.0, 1.0, 0.0], "brevity": [1.0, 0.0, 1.0]}
    assert scores.total.tolist() == [1.5, 1.0, 0.5]


def test_the_task_library_and_agent_commands_name_what_exists():
    (library,) = [line for b in blocks("") for line in b.splitlines() if "reasoning-gym:" in line]
    spec = parse(shlex.split(library)[2:])
    assert str(spec.up.dataset) == "reasoning-gym:simple_equations" and spec.up.dataset_size == 8
    assert "--environment examples.agents_sdk:adder" in PAGE.replace("\n", " ")
    from rollout_worker.environment import load_environment

    assert load_environment("examples.agents_sdk:adder").__name__ == "adder"
