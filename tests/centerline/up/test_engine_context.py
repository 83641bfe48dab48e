"""`centerline up` sizes its SGLang servers for one session of the whole token budget
(centerline/up/engine_context.py): the toy model's positions and the CPU's KV pool raised, a model of
yours too short for the budget, or an --sglang-args of yours too small, refused at start-up naming
the flag, the numbers and the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from centerline.up.engine_context import check_weight_transport, engine_flags, flag_value, model_positions
from centerline.up.user_task import UserTaskError
from tests.centerline.up.test_user_task import up_watched, write
from tests.processes import REPO


def model(tmp_path, positions: int | None):
    (tmp_path / "config.json").write_text(
        json.dumps({} if positions is None else {"max_position_embeddings": positions})
    )
    return tmp_path


def test_the_default_budget_needs_nothing_of_the_engines(tmp_path):
    assert engine_flags(model(tmp_path, 1024), True, 1024 - 6, [], "cpu") == []
    assert engine_flags(model(tmp_path, 8192), False, 1024, [], "cpu") == []
    assert engine_flags(tmp_path / "nowhere", False, 1024, [], "cpu") == []  # no config.json: SGLang says


def test_the_toy_models_positions_and_the_cpu_kv_pool_hold_a_long_session(tmp_path):
    assert engine_flags(model(tmp_path, 1024), True, 24576, [], "cpu") == [
        "--json-model-override-args",
        '{"max_position_embeddings": 24582}',
        "--max-total-tokens",
        "24582",
    ]
    assert engine_flags(model(tmp_path, 1024), True, 24576, [], "cuda") == [
        "--json-model-override-args",
        '{"max_position_embeddings": 24582}',
    ]  # a GPU's pool is sized by its memory
    # flags of yours that hold it are yours
    yours = ["--context-length", "32768", "--max-total-tokens=40000"]
    assert engine_flags(model(tmp_path, 1024), True, 24576, yours, "cpu") == []


def test_a_model_of_yours_too_short_for_the_budget_is_refused_naming_both_and_the_fix(tmp_path):
    with pytest.raises(UserTaskError) as err:
        engine_flags(model(tmp_path, 8192), False, 24576, [], "cpu")
    assert str(err.value).startswith(
        f"--rollout-session-max-tokens 24576: the model {tmp_path} holds 8192 positions (max_position_embeddings "
        "in its config.json) and SGLang needs 24582 for a session of that budget; lower "
        "--rollout-session-max-tokens to 8186, or give a model with a longer context"
    )
    # its positions stretched by a --context-length of yours are taken at your word
    assert engine_flags(model(tmp_path, 8192), False, 24576, ["--context-length=24582"], "cuda") == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--context-length", "4096"],
            "--sglang-args --context-length 4096 is shorter than a session of --rollout-session-max-tokens 8192 "
            "(SGLang needs 8198); raise it to 8198, or lower --rollout-session-max-tokens to 4090",
        ),
        (
            ["--max-total-tokens", "2048"],
            "--sglang-args --max-total-tokens 2048 holds less than one session of --rollout-session-max-tokens 8192 "
            "(SGLang needs 8198); raise it to 8198 or more",
        ),
    ],
)
def test_sglang_args_too_small_for_the_budget_are_refused(tmp_path, args, message):
    with pytest.raises(UserTaskError) as err:
        engine_flags(model(tmp_path, 32768), False, 8192, args, "cpu")
    assert str(err.value) == message


def test_positions_and_flags_are_read_as_sglang_and_transformers_write_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert model_positions(tmp_path) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))
    assert model_positions(tmp_path) == 1024
    assert flag_value(["--a", "1", "--context-length", "5", "--context-length=7"], "--context-length") == "7"
    assert flag_value(["--context-length-x", "5"], "--context-length") is None


@pytest.mark.slow  # `centerline up` up to its refusal: seconds, not the fast tier
def test_up_refuses_a_budget_its_model_cannot_hold_before_starting_anything(model_dir, tmp_path):
    mine = shutil.copytree(model_dir, tmp_path / "mine")  # the byte-level model: 1024 positions
    data = write(tmp_path / "d.jsonl", {"prompt": "p", "answer": "a"})
    flags = ["--model", str(mine), "--dataset", data, "--rollout-session-max-tokens", "4096"]
    run, started = up_watched([*flags, "--run-dir", str(tmp_path / "run")], REPO)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"centerline up: --rollout-session-max-tokens 4096: the model {mine} holds 1024 positions" in run.stderr
    # no process (NATS, SGLang, a service) and no port; ctypes' library lookup (ldconfig -p) on the
    # tokenizer's import is not one of the run's
    assert [s for s in started if "ldconfig" not in s] == []


@pytest.mark.parametrize(
    ("device", "where"), [("cuda", "on GPU 0 beside trainer rank 0 (--engine-device cuda)"), ("cpu", "on the CPU")]
)
def test_the_distributed_transport_with_the_trainer_on_cuda_is_refused_naming_the_fix(device, where):
    """up serves its engines on GPU 0 or the CPU: neither joins the CUDA trainer's NCCL group."""
    with pytest.raises(UserTaskError) as refused:
        check_weight_transport("distributed", device, trainer_on_cuda=True)
    assert where in str(refused.value) and "use --weight-transport disk" in str(refused.value)
    for transport, on_cuda in (("distributed", False), ("disk", True), ("disk", False)):
        check_weight_transport(transport, device, trainer_on_cuda=on_cuda)  # gloo on the CPU, or the disk
