"""`docker-compose up`, for real: the compose topology starts, trains, scales and goes away.

The commands are the README's (section "Docker Compose"), run verbatim in the repository root:
deploy/docker/prepare.sh installs Docker Engine, docker-compose and debootstrap from Debian's
packages where they are missing, starts dockerd where none answers and builds a base image from
Debian packages (no container registry is needed); `docker-compose up -d --build` builds the
centerline image on it and starts NATS, two SGLang servers on the CPU, the SGLang router, the
trainer, the proxy and a worker. The tests then read what the services report, scale the workers
and tear it all down. Image layers stay cached between runs; a daemon this module started is
stopped at the end.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.compose import prebuild

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
PREPARE = "deploy/docker/prepare.sh"
UP = "docker-compose up -d --build"
SCALE = "docker-compose up -d --scale rollout_worker=3"
DOWN = "docker-compose down -v"
STEPS = 5  # trainer steps to see before the checks


def sh(command: str, timeout: float = 600) -> str:
    """Run ``command`` in the repository root; its output, or a failure that shows it."""
    started = time.monotonic()
    proc = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(f"compose-test: {command!r} rc={proc.returncode} in {time.monotonic() - started:.1f}s", flush=True)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def exec_in(service: str, *argv: str, index: int = 1) -> str:
    return sh(f"docker-compose exec -T --index={index} {service} {shlex.join(argv)}")


def http_get(service: str, url: str, index: int = 1) -> str:
    """GET ``url`` from inside a container of ``service`` (the image has Python, not curl)."""
    code = (
        "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    )
    return exec_in(service, "python", "-c", code, url, index=index)


def wait_for(what: str, check, timeout: float, interval: float = 2.0):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except AssertionError as exc:  # a command failed: the service may still be starting
            value, last = None, exc
        else:
            last = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s" + (f"; last failure: {last}" if last else ""))
        time.sleep(interval)


def steps() -> list[dict]:
    text = exec_in("trainer", "sh", "-c", "cat /runs/main/metrics.jsonl 2>/dev/null || true")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def evaluations() -> list[dict]:
    """The trainer's held-out figures so far (docs/design.md section 9), one per evaluated step."""
    text = exec_in("trainer", "sh", "-c", "cat /runs/main/heldout_metrics.jsonl 2>/dev/null || true")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def counter(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets) in an exposition ``text``."""
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def project_resources() -> tuple[list[str], list[str]]:
    project = re.sub(r"[^-_a-z0-9]", "", ROOT.name.lower())  # as docker-compose names the project
    label = f"label=com.docker.compose.project={project}"
    containers = sh(f"docker ps -a -q --filter {label}").split()
    volumes = sh(f"docker volume ls -q --filter {label}").split()
    return containers, volumes


@pytest.fixture(scope="module")
def stack():
    print(prebuild.wait(), flush=True)  # the set-up and build begun with the session (tests/conftest.py)
    sh(PREPARE, timeout=900)
    sh(DOWN)  # what an earlier, interrupted run left
    started = time.monotonic()
    sh(UP, timeout=1800)
    print(f"compose-test: up (build and start) took {time.monotonic() - started:.0f}s", flush=True)
    yield
    subprocess.run(DOWN, shell=True, cwd=ROOT, capture_output=True, timeout=300)


def test_the_readme_has_these_commands():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Docker Compose") :]
    block = block[: block.index("\n## ")] if "\n## " in block else block
    for command in (PREPARE, UP, SCALE, DOWN):
        assert command in block, command


def test_the_trainer_trains_on_what_the_engines_sampled(stack):
    records = wait_for(f"{STEPS} trainer steps", lambda: (r := steps()) and len(r) >= STEPS and r, 900)
    assert [r["step"] for r in records[:STEPS]] == list(range(1, STEPS + 1))
    assert all(r["gate_accepted"] > 0 and r["gate_rejected"] == {} for r in records)
    assert all(r["samples"] > 0 and r["trained_tokens"] > 0 for r in records)
    exposition = http_get("trainer", "http://127.0.0.1:9300/metrics")
    assert counter(exposition, "centerline_trainer_gate_accepted_total") >= STEPS
    assert counter(exposition, "centerline_trainer_gate_rejected_total") == 0


def test_the_trainer_records_a_heldout_curve_never_trained(stack):
    """docker-compose.yml's trainer evaluates its 64 held-out rows (heldout_init) before training
    and every 5 steps through the same workers, proxy and router: heldout_metrics.jsonl and /metrics."""
    records = wait_for("held-out figures of steps 0 and 5", lambda: (r := evaluations()) and len(r) >= 2 and r, 900)
    curve = [(r["step"], r["heldout_accuracy"], r["heldout_s"]) for r in records]
    print(f"\ncompose-test: held-out curve {curve}", flush=True)
    assert [r["step"] for r in records[:2]] == [0, 5]
    assert all(r["heldout_rows"] == 64 and 0.0 <= r["heldout_accuracy"] <= 1.0 for r in records)
    assert all(r["heldout_version_min"] >= r["version"] for r in records)  # sampled by the step's weights or later
    assert not any("/heldout/" in batch for r in steps() for batch in r["batch_ids"])
    exposition = http_get("trainer", "http://127.0.0.1:9300/metrics")
    assert counter(exposition, "centerline_trainer_heldout_step") >= 5
    assert counter(exposition, "centerline_trainer_heldout_rows") == 64


def test_the_proxy_is_ready_and_learned_the_vocabulary(stack):
    ready = json.loads(http_get("router_proxy", "http://127.0.0.1:30010/ready"))
    assert ready["ready"] is True and ready["cause"] is None
    info = json.loads(http_get("router_proxy", "http://127.0.0.1:30010/get_model_info"))
    assert info["vocab_size"] == 260  # the default model's (init-model), learned from SGLang
    # the image's wheel has the C row scanner compiled (deploy/Dockerfile's first stage)
    started = [
        line for line in sh("docker-compose logs --no-color router_proxy").splitlines() if "proxy on http" in line
    ]
    assert started and all("candidate rows scanned by the c scanner)" in line for line in started), started


def test_each_service_holds_only_its_own_secrets(stack):
    env = dict(line.split("=", 1) for line in exec_in("nats", "cat", "/etc/nats/credentials/nats.env").splitlines())
    for service, user in (("trainer", "trainer"), ("router_proxy", "proxy"), ("rollout_worker", "worker")):
        assert exec_in(service, "ls", "/run/centerline/nats").split() == ["password"]
        password = exec_in(service, "cat", "/run/centerline/nats/password").strip()
        assert env[f"CENTERLINE_NATS_{user.upper()}_PASSWORD"] == password
    key = exec_in("trainer", "cat", "/run/centerline/engine-admin/admin-api-key")
    assert len(key) >= 32
    listing = "ls /run/centerline 2>/dev/null || true"
    assert exec_in("trainer", "sh", "-c", listing).split() == ["engine-admin", "nats"]
    for service, mounted in (("router_proxy", ["nats"]), ("rollout_worker", ["nats"]), ("sglang_router", [])):
        assert exec_in(service, "sh", "-c", listing).split() == mounted, service


# Run inside a container: the status of each URL given (POST for the admin routes), or
# "unreachable" when nothing answers (a name no network of the container resolves, a refusal).
PROBE = """
import json, sys, urllib.error, urllib.request
found = {}
for url in sys.argv[1:]:
    post = url.endswith(("/update_weights_from_disk", "/flush_cache"))
    request = urllib.request.Request(url, data=b"{}" if post else None, method="POST" if post else "GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            found[url] = [resp.status, resp.read().decode()]
    except urllib.error.HTTPError as exc:
        found[url] = [exc.code, exc.read().decode()]
    except OSError:
        found[url] = "unreachable"
print(json.dumps(found))
"""
ADMIN_PATHS = ("/server_info", "/get_server_info", "/update_weights_from_disk", "/flush_cache", "/health")


def test_a_worker_reaches_no_engine_and_the_proxy_gives_it_no_key(stack):
    """Workers run user environment code: no engine and not the router's front answers them
    (docs/design.md section 11), and the proxy, which they do reach, refuses /server_info."""
    key = exec_in("trainer", "cat", "/run/centerline/engine-admin/admin-api-key")
    hosts = ("sglang_0:30000", "sglang_1:30000", "sglang_router:30000")
    urls = [f"http://{host}{path}" for host in hosts for path in ADMIN_PATHS]
    proxy = "http://router_proxy:30010/server_info"
    found = json.loads(exec_in("rollout_worker", "python", "-c", PROBE, *urls, proxy))
    assert {url: found[url] for url in urls} == dict.fromkeys(urls, "unreachable")
    assert found[proxy][0] == 403 and key not in found[proxy][1]


def test_no_engine_process_shows_the_key_on_its_command_line(stack):
    """The key reaches SGLang in a --config file (centerline/engine_key.py), removed once the
    server answers: no process of an engine container carries it in /proc/PID/cmdline."""
    key = exec_in("trainer", "cat", "/run/centerline/engine-admin/admin-api-key")
    for engine in ("sglang_0", "sglang_1"):
        cmdlines = exec_in(engine, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\000' ' '")
        assert "sglang.launch_server" in cmdlines and "--config" in cmdlines and key not in cmdlines, engine
        assert exec_in(engine, "sh", "-c", "ls -d /tmp/centerline-sglang-* 2>/dev/null || true").strip() == ""


# A weight group of the distributed transport (trainer_service/broadcast.py), made by hand between
# the trainer's container and an engine's: the trainer's end as the trainer makes it, the engine's
# by SGLang's own init_custom_process_group, as /init_weights_update_group calls it.
GROUP_TRAINER = """
import socket, sys, torch
from trainer_service.broadcast import Group, buckets, interface_towards
own = interface_towards(socket.gethostbyname(socket.gethostname()))
route = interface_towards("sglang_0")
print("hostname-interface", own, "route-interface", route, flush=True)
group = Group("trainer", "gloo", 120.0, "compose-check", route)
print("port", group.port, flush=True)
group.join()
(bucket,) = buckets({"w": torch.arange(4, dtype=torch.float32)}, 1 << 20)
group.send(bucket)
print("sent", flush=True)
"""
GROUP_ENGINE = """
import json, sys, torch, torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
group = init_custom_process_group(
    backend="gloo", init_method=f"tcp://trainer:{sys.argv[1]}", world_size=2, rank=1, group_name="compose-check"
)
flat = torch.empty(4)
dist.broadcast(flat, src=0, group=group)
print(json.dumps(flat.tolist()))
"""


def test_a_weight_group_joins_across_the_engines_network(stack):
    """The trainer is on two networks; its host name resolves to its address on `default`, where
    no engine is, so gloo's own choice of interface cannot be reached from an engine. The trainer's
    end binds the interface its route to the engine leaves by, and the engine's end connects."""
    trainer = subprocess.Popen(
        ["docker-compose", "exec", "-T", "trainer", "python", "-c", GROUP_TRAINER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, hostname_interface, _, route_interface = trainer.stdout.readline().split()
        assert hostname_interface != route_interface  # the case the binding is for
        port = trainer.stdout.readline().split()[1]
        assert json.loads(exec_in("sglang_0", "python", "-c", GROUP_ENGINE, port).splitlines()[-1]) == [0, 1, 2, 3]
        out, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 0 and out.split() == ["sent"], err[-2000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()


def test_scaled_workers_take_tasks(stack):
    sh(SCALE)
    containers = sh("docker-compose ps -q rollout_worker").split()
    assert len(containers) == 3

    def tasks(index: int) -> float:
        return counter(
            http_get("rollout_worker", "http://127.0.0.1:9400/metrics", index=index), "centerline_worker_tasks_total"
        )

    for index in (2, 3):
        wait_for(f"worker {index} finishing a task", lambda index=index: tasks(index) > 0, 300)
    done = steps()
    assert all(r["gate_rejected"] == {} for r in done)


def test_down_removes_the_containers_and_volumes(stack):
    sh(DOWN)
    assert project_resources() == ([], [])
