"""`centerline up`'s wiring, without starting anything: what each child process is given."""

from centerline.launcher import service_env
from shared import nats_auth

PASSWORDS = {"admin": "pa", "trainer": "pt", "worker": "pw", "proxy": "pp"}
# What a launcher's own environment may hold: somebody else's credentials, among ordinary variables.
BASE = {
    "PATH": "/usr/bin",
    "CENTERLINE_SEED": "3",
    "CENTERLINE_NATS_USER": "admin",
    "CENTERLINE_NATS_PASSWORD": "x",
    "CENTERLINE_NATS_PASSWORD_FILE": "/f",
    **nats_auth.server_env({u: "x" for u in nats_auth.USERS}),
}


def nats_variables(env: dict) -> dict:
    return {k: v for k, v in env.items() if "NATS" in k}


def test_each_service_gets_its_own_nats_user_and_password_only():
    got = {user: nats_variables(service_env(BASE, user, PASSWORDS)) for user in ("trainer", "worker", "proxy")}
    assert got == {
        "trainer": {"CENTERLINE_NATS_USER": "trainer", "CENTERLINE_NATS_PASSWORD": "pt"},
        "worker": {"CENTERLINE_NATS_USER": "worker", "CENTERLINE_NATS_PASSWORD": "pw"},
        "proxy": {"CENTERLINE_NATS_USER": "proxy", "CENTERLINE_NATS_PASSWORD": "pp"},
    }


def test_a_service_without_nats_gets_no_credentials_and_keeps_the_rest_of_the_environment():
    env = service_env(BASE, None, PASSWORDS)
    assert nats_variables(env) == {}
    assert (env["PATH"], env["CENTERLINE_SEED"], env["HF_HUB_OFFLINE"]) == ("/usr/bin", "3", "1")
