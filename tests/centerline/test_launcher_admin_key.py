"""`centerline up` gives the engine's admin key to the engine and the trainer, and to no other process."""

import sys

from centerline.launcher import Stack
from shared import admin_key

SHOW = "import os; print(os.environ.get('CENTERLINE_ENGINE_ADMIN_API_KEY'), os.environ.get('CENTERLINE_ENGINE_ADMIN_API_KEY_FILE'))"


def test_only_the_processes_given_the_key_hold_it(tmp_path, monkeypatch):
    monkeypatch.setenv(admin_key.KEY_ENV, "the-launchers-own")  # never inherited
    monkeypatch.setenv(admin_key.KEY_FILE_ENV, "/the/launchers/own")
    stack = Stack(tmp_path, {})
    for name, key in (("engine", "k1"), ("trainer", "k1"), ("proxy", None), ("worker-0", None)):
        stack.start(name, [sys.executable, "-c", SHOW], engine_key=key).wait(60)
    shown = {name: (tmp_path / f"{name}.log").read_text().strip() for name in ("engine", "trainer", "proxy", "worker-0")}
    assert shown == {"engine": "k1 None", "trainer": "k1 None", "proxy": "None None", "worker-0": "None None"}


def test_each_run_gets_a_new_random_key():
    keys = {admin_key.new_key() for _ in range(3)}
    assert len(keys) == 3 and all(len(k) == 43 for k in keys)  # 32 random bytes, URL-safe base64
