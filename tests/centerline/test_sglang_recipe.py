"""`centerline sglang`'s environment: the CPU recipe's variables (docs/sglang.md), a user's own kept; and
`centerline router`, the router `up` starts."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from centerline import sglang
from tests.processes import ENV, REPO


def test_the_cpu_recipe_turns_off_the_crash_diagnostics_unless_the_user_set_them():
    env = sglang.server_env({"PATH": "/usr/bin"}, "cpu")
    assert {k: env[k] for k in sglang.CRASH_DIAGNOSTICS} == {
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    }
    assert (env["SGLANG_USE_CPU_ENGINE"], env["OMP_NUM_THREADS"]) == ("1", "1")
    mine = sglang.server_env({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1", "OMP_NUM_THREADS": "2"}, "cpu")
    assert (mine["SGLANG_PYSPY_DUMP_BEFORE_CRASH"], mine["OMP_NUM_THREADS"]) == ("1", "2")


def test_on_gpus_sglang_keeps_its_own_diagnostics():
    env = sglang.server_env({"PATH": "/usr/bin"}, "cuda")
    assert not set(sglang.CRASH_DIAGNOSTICS) & set(env)
    assert "SGLANG_USE_CPU_ENGINE" not in env


def router_flags(argv: list[str]) -> list[str]:
    run = subprocess.run([*argv, "--help"], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr
    return sorted(set(re.findall(r"(?<![\w-])--[a-z][\w-]+", run.stdout)) - {"--help"})


@pytest.mark.slow  # smg launch --help and the router, processes of seconds: not the fast tier
def test_the_router_command_takes_every_flag_of_smg_launch_and_never_imports_sglang():
    """`centerline router` is `smg launch`'s parser and Rust router: the same flags, and none of
    SGLang imported on the way (what `smg launch` spends its start-up on)."""
    ours = router_flags([sys.executable, *sglang.ROUTER_PROGRAM])
    assert ours == router_flags([str(Path(sys.executable).parent / "smg"), "launch"])
    assert len(ours) > 50
    probe = (
        "import sys; from centerline import sglang; "
        "sys.argv = ['centerline router', '--worker-urls', 'http://127.0.0.1:1', '--mini-lb']\n"
        "try: sglang.router_main(sys.argv[1:])\n"
        "except SystemExit as exit: print(exit.code, sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert run.stdout == "2 []\n"
    assert run.stderr.endswith(
        "centerline router: error: --mini-lb: the Python debugging balancer is not started here; "
        "use `smg launch --mini-lb`\n"
    )


def test_up_starts_the_router_by_the_router_command():
    argv = sglang.router_argv(["http://127.0.0.1:1", "http://127.0.0.1:2"], "127.0.0.1", 3, 4)
    assert argv[:4] == [sys.executable, "-m", "centerline", "router"]
    assert argv[4:8] == ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy"]
