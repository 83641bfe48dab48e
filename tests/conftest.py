"""Fixtures shared across test packages."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torch_threads_sleep_when_idle() -> None:
    """torch's OpenMP threads in this process wait passively (OMP_WAIT_POLICY, read once, when
    libgomp loads with torch) instead of spinning, unless the environment says otherwise: with
    the cores shared, spinning threads make the in-process training tests several times slower.
    The processes the tests start inherit the environment as it was."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        import torch  # noqa: F401  (libgomp reads the policy now)
    finally:
        del os.environ["OMP_WAIT_POLICY"]


# On import, not in pytest_configure: pytest imports the conftest of each directory it is given
# (tests/trainer_service/conftest.py imports torch) before it configures, and this one first.
torch_threads_sleep_when_idle()


SESSION_VARIABLE = "CENTERLINE_TEST_SESSION"  # set by the session's reporting process


def pytest_configure(config):
    """The reporting process writes what the session took (tests/suite_figures.py): not an xdist
    worker, nor a pytest that a test runs (tests/test_simd_paths.py), which the variable marks."""
    if not hasattr(config, "workerinput") and SESSION_VARIABLE not in os.environ:
        os.environ[SESSION_VARIABLE] = str(os.getpid())
        from tests.suite_figures import SuiteFigures

        config.pluginmanager.register(SuiteFigures(config), "suite-figures")


# Under pytest-xdist (`make test` runs two workers) each worker starts the session fixtures it
# uses; the tests that share one costly start, or a resource of the machine, run on one worker.
XDIST_GROUPS = {  # fixture -> group: each fixture started by one worker only
    "up_run": "up_run",  # one 3-step `centerline up` read by several files
    "keyed_sglang": "keyed_sglang",  # the second SGLang server
    "real_sglang": "real_model",  # the real-model tier: one server, one model cache of the machine
    "real_model": "real_model",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    """The compose tests run last (their set-up begins with the session, see below), on one
    xdist worker: they share one Docker daemon and one `docker-compose` project."""
    compose = [item for item in items if item.get_closest_marker("compose")]
    items[:] = [item for item in items if not item.get_closest_marker("compose")] + compose
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = "compose" if item.get_closest_marker("compose") else None
        group = group or next((g for f, g in XDIST_GROUPS.items() if f in getattr(item, "fixturenames", ())), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if config.getoption("loadgroup", False) and not hasattr(item, "_nodeid"):  # an xdist worker
                # xdist 3.8 groups by a "@group" suffix it writes to item._nodeid, which pytest 9.2
                # no longer reads (the id lives in item._id): written there, as xdist would
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(f"{item.nodeid}@{group}")


def pytest_collection_finish(session):
    """The compose tests' Docker set-up and image build begin now in the background
    (tests/compose/prebuild.py): minutes on a machine that never built the image. Under xdist
    the controller begins it (below), not each worker."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    if any(item.get_closest_marker("compose") for item in session.items):
        from tests.compose import prebuild

        prebuild.start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller's view of a worker's collection (ids, no markers): the compose set-up
    begins once, if tests/compose is in it."""
    if any(nodeid.startswith("tests/compose/") for nodeid in ids):
        from tests.compose import prebuild

        prebuild.start()


def pytest_sessionfinish(session):
    """A Docker daemon the compose tier's set-up started is stopped at the end of the session
    (by the process that started it: under xdist the controller, once every worker is done)."""
    from tests.compose import prebuild

    prebuild.stop()


@dataclass(frozen=True)
class UpRun:
    """A finished `centerline up`: its run directory (JetStream store included) and output."""

    run_dir: Path
    model_dir: Path  # the init-model output the engine and trainer started from
    stdout: str
    steps: int = 3
    prompts_per_step: int = 3
    rollout_n: int = 2


@pytest.fixture(scope="session")
def toy_models(tmp_path_factory) -> Path:
    """One ``--model-dir`` for every `centerline up` of the session: each toy task's SFT warm start
    is made once (``sft-<task>-seed<n>``, kept by its settings) and read by the runs after (12 s each
    here). A run that asks for other SFT settings (``--sft-steps``) takes a directory of its own."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def up_run(tmp_path_factory, toy_models) -> UpRun:
    """One 3-step run of the whole topology (NATS, engine, proxy, two workers, a 2-rank trainer),
    shared by the end-to-end tests: the report, the pipeline's leftovers and record/replay all
    read the same finished run instead of starting their own (each start costs a minute here)."""
    tmp = tmp_path_factory.mktemp("up")
    run_dir = tmp / "run"
    argv = [
        sys.executable,
        "-m",
        "centerline",
        "up",
        "--task",
        "copy",
        "--steps",
        "3",
        "--workers",
        "2",
        "--trainer-ranks",
        "2",
        "--prompts-per-step",
        "3",
        "--rollout-n",
        "2",
        "--heldout-prompts",
        "8",
        "--heldout-every",
        "2",
        "--model-dir",
        str(toy_models),
        "--run-dir",
        str(run_dir),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return UpRun(run_dir=run_dir, model_dir=toy_models / "sft-copy-seed0", stdout=run.stdout)


def made_model(out: Path, seed: int) -> Path:
    """`centerline init-model --out OUT --seed SEED` run in this process: the same ``main``
    without a new interpreter importing torch (~3 s a model here), the session's torch RNG
    untouched. tests/sglang/test_model.py checks the command's output is byte for byte this."""
    import torch

    from centerline.toy import model_init

    with torch.random.fork_rng(devices=[]):
        assert model_init.main(["--out", str(out), "--seed", str(seed)]) == 0
    return out


@pytest.fixture(scope="session")
def make_model():
    """``made_model``, for the fixtures of other packages (tests/sglang/conftest.py)."""
    return made_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The random seed-0 default model (`centerline init-model`), what the shared SGLang server serves."""
    return made_model(tmp_path_factory.mktemp("model") / "seed0", seed=0)


@pytest.fixture(scope="session")
def keyed_sglang(model_dir, tmp_path_factory):
    """A second SGLang server of ``model_dir`` for the tests that need one unlike the shared one:
    it holds an admin key (``tests.processes.ADMIN_KEY``: tests/sglang/test_admin_key.py) and
    counts its requests (``--enable-metrics``: tests/centerline/test_bench_sessions.py). One start
    serves both (each costs ~25 s here); neither depends on the weights it serves."""
    from shared import admin_key
    from tests.processes import ADMIN_KEY, SGLangProcess

    log = tmp_path_factory.mktemp("keyed-sglang") / "sglang.log"
    server = SGLangProcess(model_dir, log, "--enable-metrics", env={admin_key.KEY_ENV: ADMIN_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sglang_server(model_dir, tmp_path_factory):
    """The one SGLang server of the test session (real sglang, CPU), started on first use.
    Tests take it through ``sglang``, which hands it over serving ``model_dir``."""
    from tests.processes import SGLangProcess

    server = SGLangProcess(model_dir, tmp_path_factory.mktemp("sglang") / "sglang.log")
    yield server
    server.stop()


@pytest.fixture
def sglang(sglang_server, model_dir):
    """The shared SGLang server, alive and serving ``model_dir`` at weight version "default":
    restarted if an earlier test stopped it, and its weights put back if one loaded others
    (a trainer loads its own versions). A test may load weights; it must not change flags."""
    return sglang_server.serve(model_dir)


@pytest.fixture(scope="session")
def sglang_router(sglang_server, tmp_path_factory):
    """The real SGLang router (smg) in front of the shared server, as `centerline up` runs it."""
    from tests.processes import Router

    router = Router(tmp_path_factory.mktemp("router") / "router.log", [sglang_server.url])
    yield router
    router.stop()
