"""The engines' admin key reaches SGLang in a ``--config`` file, never on a command line
(centerline/engine_key.py): the file SGLang's own parser turns into the key, the key files
compose's one-shot writes, and the flags `centerline sglang` keeps to itself. The running
server's command lines: tests/sglang/test_admin_key.py."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from centerline import engine_key, sglang
from shared import admin_key
from tests.processes import ENV, REPO


@pytest.fixture(scope="module")
def sglang_reads():
    """``config path -> the admin_api_key SGLang 0.5.23 parses``, by its own argument parser and
    config merger (``prepare_server_args`` without the model's resolution)."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)

    def read(config) -> str | None:
        argv = ConfigArgumentMerger(parser).merge_config_with_args(["--model-path", "m", "--config", str(config)])
        return parser.parse_args(argv).admin_api_key

    return read


# a new key's id is fixed: the key itself differs between xdist workers, whose collections must agree
@pytest.mark.parametrize(
    "key",
    ["k3y", "0x10", "yes", "null", "1_000", "a b", 'q"\\', "é", pytest.param(engine_key.new_key(), id="new_key")],
)
def test_sglang_reads_back_the_key_the_config_file_gives(sglang_reads, key):
    config = engine_key.private_config(key)
    try:
        assert sglang_reads(config) == key
    finally:
        engine_key.forget(config)


def test_sglang_cannot_read_a_key_beginning_with_a_dash_from_its_config_file(sglang_reads, tmp_path, capsys):
    """Why such a key is refused below: SGLang turns the file into ``--admin-api-key -k3y``."""
    (tmp_path / "admin.yaml").write_text('admin-api-key: "-k3y"\n')
    with pytest.raises(SystemExit) as info:
        sglang_reads(tmp_path / "admin.yaml")
    assert info.value.code == 2 and "argument --admin-api-key: expected one argument" in capsys.readouterr().err


def test_a_key_sglang_would_read_as_a_flag_is_refused():
    with pytest.raises(admin_key.AdminKeyError) as info:
        engine_key.sglang_config("-k3y")
    assert str(info.value) == (
        "the engines' admin key (CENTERLINE_ENGINE_ADMIN_API_KEY or the file CENTERLINE_ENGINE_ADMIN_API_KEY_FILE "
        'names) begins with "-", which SGLang reads back from its --config file as a flag; make a new one: '
        "python -c 'import secrets; print(secrets.token_hex(32))'"
    )


def test_new_keys_are_random_hex_that_never_begins_with_a_dash():
    keys = {engine_key.new_key() for _ in range(64)}
    assert len(keys) == 64 and all(len(k) == 64 and int(k, 16) >= 0 and k[0] != "-" for k in keys)


def test_the_private_config_is_the_owners_alone_and_forgotten_whole():
    config = engine_key.private_config("k3y")
    assert (stat.S_IMODE(config.parent.stat().st_mode), stat.S_IMODE(config.stat().st_mode)) == (0o700, 0o600)
    assert (config.name, config.read_text(), os.listdir(config.parent)) == (
        "sglang-admin.yaml",
        'admin-api-key: "k3y"\n',
        ["sglang-admin.yaml"],
    )
    engine_key.forget(config)
    assert not config.parent.exists()


class _Starting(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)  # SGLang's /health while its scheduler starts
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_config_is_removed_once_the_server_answers_even_503():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Starting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = engine_key.private_config("k3y")
    try:
        # this process's parent stands for the server that forked the helper
        engine_key.forget_once_read(f"http://127.0.0.1:{server.server_port}", config, os.getppid())
    finally:
        server.shutdown()
    assert not config.parent.exists()


def test_the_config_is_removed_when_the_server_is_gone_without_answering():
    config = engine_key.private_config("k3y")
    engine_key.forget_once_read("http://127.0.0.1:9", config, server_pid=-1)  # -1: never this process's parent
    assert not config.parent.exists()


def test_compose_key_files_keep_the_key_and_rewrite_sglangs_file_from_it(tmp_path, sglang_reads):
    made = engine_key.write_key_files(tmp_path)
    key = (tmp_path / "admin-api-key").read_text()
    assert made == {
        "key": str(tmp_path / "admin-api-key"),
        "config": str(tmp_path / "sglang-admin.yaml"),
        "new_key": True,
    }
    assert len(key) == 64 and sglang_reads(tmp_path / "sglang-admin.yaml") == key
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "admin-api-key": 0o600,
        "sglang-admin.yaml": 0o600,
    }
    (tmp_path / "sglang-admin.yaml").write_text('admin-api-key: "stale"\n')
    assert engine_key.write_key_files(tmp_path)["new_key"] is False
    assert (tmp_path / "admin-api-key").read_text() == key and sglang_reads(tmp_path / "sglang-admin.yaml") == key


def test_an_empty_compose_key_file_is_named(tmp_path):
    (tmp_path / "admin-api-key").write_text("")
    with pytest.raises(admin_key.AdminKeyError, match=f"^{tmp_path}/admin-api-key: the key file is empty; delete it"):
        engine_key.write_key_files(tmp_path)


def test_engine_key_command_prints_what_it_wrote(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "centerline", "engine-key", str(tmp_path / "credentials")],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["config"] == str(tmp_path / "credentials" / "sglang-admin.yaml")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--config", "mine.yaml"], "--config"),
        (["--config=mine.yaml"], "--config"),
        (["--admin-api-key", "k"], "--admin-api-key"),
        (["--tp-size", "1", "--admin-api-key=k"], "--admin-api-key"),
    ],
)
def test_centerline_sglang_keeps_the_config_and_key_flags_to_itself(tmp_path, extra, flag):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "centerline", "sglang", "--model", str(tmp_path), "--", *extra],
        cwd=REPO,
        env={**ENV, admin_key.KEY_ENV: "k3y"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == f"centerline sglang: error: {sglang.flags_left_to_us(extra)}"
    assert sglang.flags_left_to_us(extra).startswith(f"{flag} after --: the admin key reaches SGLang in the --config")


def test_other_sglang_flags_pass():
    assert sglang.flags_left_to_us(["--tp-size", "2", "--enable-metrics", "--api-key", "user-key"]) is None


def test_centerline_sglang_refuses_a_key_beginning_with_a_dash_before_starting(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "centerline", "sglang", "--model", str(tmp_path)],
        cwd=REPO,
        env={**ENV, admin_key.KEY_ENV: "-k3y"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and 'begins with "-", which SGLang reads back' in out.stderr
