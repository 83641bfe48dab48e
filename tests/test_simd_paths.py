"""The numeric tests again with torch's and numpy's vector paths held to narrower machines'.

torch picks its CPU kernels (and so its summation orders) by the widest vector unit it finds, and
numpy dispatches the same way; a tolerance that only absorbs this machine's rounding passes here
and fails on a user's AVX2-only processor (issue 20). Each run below limits both, as
``ATEN_CPU_CAPABILITY`` and ``NPY_DISABLE_CPU_FEATURES`` do, and must pass as the full-width run
does. A level this processor lacks runs at the widest it has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numpy._core import _multiarray_umath as npy_cpu

ROOT = Path(__file__).resolve().parents[1]
NUMERIC_TESTS = (
    "tests/trainer_service/test_golden.py",
    "tests/trainer_service/test_loss.py",
    "tests/trainer_service/test_step.py",
    "tests/shared/test_contract.py",
    "tests/rollout_worker/test_packing.py",
)
# torch's level, and numpy's dispatched features a processor at that level lacks.
LEVELS = {
    "default": lambda feature: True,
    "avx2": lambda feature: feature.startswith("AVX512"),
}
PROBE = (
    "import json, torch; from numpy._core import _multiarray_umath as m; "
    "print(json.dumps([torch.backends.cpu.get_cpu_capability(), "
    "[f for f in m.__cpu_dispatch__ if m.__cpu_features__.get(f)]]))"
)


def limited_env(level: str) -> dict:
    disabled = [f for f in npy_cpu.__cpu_dispatch__ if npy_cpu.__cpu_features__.get(f) and LEVELS[level](f)]
    return dict(os.environ, ATEN_CPU_CAPABILITY=level, NPY_DISABLE_CPU_FEATURES=" ".join(disabled))


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_numeric_tests_pass_with_vector_paths_limited(level):
    env = limited_env(level)
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    torch_level, numpy_features = json.loads(probe.stdout)
    assert torch_level in ({"default": ("DEFAULT",), "avx2": ("DEFAULT", "AVX2")}[level]), torch_level
    assert not [f for f in numpy_features if LEVELS[level](f)], numpy_features

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NUMERIC_TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
