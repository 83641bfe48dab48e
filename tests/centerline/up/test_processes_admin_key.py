"""`centerline up` gives the engines' admin key to the SGLang servers and the trainer, and to no other process."""

import sys

from centerline import engine_key
from centerline.up.processes import Supervisor
from shared import admin_key

SHOW = (
    "import os; print(os.environ.get('CENTERLINE_ENGINE_ADMIN_API_KEY'), "
    "os.environ.get('CENTERLINE_ENGINE_ADMIN_API_KEY_FILE'))"
)


def test_only_the_processes_given_the_key_hold_it(tmp_path, monkeypatch):
    monkeypatch.setenv(admin_key.KEY_ENV, "the-launchers-own")  # never inherited
    monkeypatch.setenv(admin_key.KEY_FILE_ENV, "/the/launchers/own")
    supervisor = Supervisor(tmp_path, {})
    given = {"sglang-0": "k1", "trainer": "k1", "router": None, "proxy": None, "worker-0": None}
    for name, key in given.items():
        supervisor.start(name, [sys.executable, "-c", SHOW], engine_key=key).wait(60)
    shown = {name: (tmp_path / f"{name}.log").read_text().strip() for name in given}
    assert shown == {
        "sglang-0": "k1 None",
        "trainer": "k1 None",
        "router": "None None",
        "proxy": "None None",
        "worker-0": "None None",
    }


def test_each_run_gets_a_new_random_key():
    keys = {engine_key.new_key() for _ in range(3)}
    assert len(keys) == 3 and all(len(k) == 64 for k in keys)  # 32 random bytes, hex
