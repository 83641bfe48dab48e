"""`centerline sglang`'s environment: the CPU recipe's variables (docs/sglang.md), a user's own kept."""

from centerline import sglang


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
