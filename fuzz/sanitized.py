"""The C scanner (``router_proxy/_rowscan.c``) built with AddressSanitizer and UBSan, and the proxy's fuzz
target (``fuzz/fuzz_proxy_audit.py``'s ``TestOneInput``) run against it: the C code that parses
untrusted bytes.

    .venv/bin/python -m fuzz.sanitized --canary --runs 3000

1. gcc builds ``router_proxy/_rowscan.c`` with ``-fsanitize=address,undefined -fno-sanitize-recover=all``
   into ``build/asan/`` (ignored by git); the normal extension in ``shared/`` stays as it is.
2. A child python runs the target with gcc's ``libasan.so`` preloaded (a sanitized extension
   cannot load into an uninstrumented python otherwise), ``ASAN_OPTIONS=detect_leaks=0``
   (CPython keeps objects until exit by design) and ``PYTHONMALLOC=malloc`` (every Python object,
   each response body among them, its own allocation, so that a read past one is seen). The
   sanitized module is put in place of ``router_proxy._rowscan`` before anything imports it; the child
   prints its file and checks that the scanner in use is it. It feeds the target ``--runs``
   inputs: the target's seeds, one large body (its rows outgrow the scanner's first buffer),
   the files of any corpus directory given, each mutated 1 to 4 times by the target's
   structural mutations or byte edits (set, cut, insert, truncate), from ``--seed``. A memory
   error or undefined behaviour aborts the child with the sanitizer's report, a finding of the
   target raises; either way this script exits non-zero and ``build/asan/last-input`` holds
   the input.
3. ``--canary``, first: a tiny extension that reads one byte past a heap buffer, and one that
   overflows a signed int, each loaded the same way, must be caught (exit non-zero, the
   sanitizer's report): the set-up does catch what it is there for.

Not libFuzzer: gcc's libasan defines the coverage callbacks atheris's libFuzzer reads, so under
it libFuzzer sees no coverage and keeps none of the corpus; the inputs here are drawn instead.
Left out: the C dependencies (orjson, numpy, msgpack, CPython) are not rebuilt, only this
repository's C code.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "asan"
SOURCE = REPO / "router_proxy" / "_rowscan.c"
FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]
CC = os.environ.get("CC", "gcc")

# The canary: one read past a 16-byte heap buffer, one signed overflow; each must stop the process.
CANARY = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

static PyObject *overread(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    char *buf = malloc(n);
    memset(buf, 0, n);
    volatile char c = buf[n];
    free(buf);
    return PyLong_FromLong(c);
}

static PyObject *overflow(PyObject *self, PyObject *arg) {
    volatile int x = INT_MAX;
    return PyLong_FromLong(x + (int)PyLong_AsLong(arg));
}

static PyMethodDef methods[] = {{"overread", overread, METH_O, NULL}, {"overflow", overflow, METH_O, NULL}, {NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "canary", NULL, -1, methods};
PyMODINIT_FUNC PyInit_canary(void) { return PyModule_Create(&module); }
"""
CANARY_CASES = {"overread(16)": "heap-buffer-overflow", "overflow(1)": "runtime error: signed integer overflow"}


def build(source: Path, name: str) -> Path:
    """``source`` compiled with the sanitizers into ``build/asan/<name><EXT_SUFFIX>`` (written whole, then renamed)."""
    BUILD.mkdir(parents=True, exist_ok=True)
    target = BUILD / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    include = sysconfig.get_paths()["include"]
    cmd = [CC, *FLAGS, "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(partial)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"sanitized build failed: {' '.join(cmd)}\n{done.stderr}")
    os.replace(partial, target)
    return target


def environment() -> dict:
    """The child's environment: gcc's ASan runtime preloaded, leaks off, UBSan reports with a stack."""
    libasan = subprocess.run([CC, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(libasan):  # gcc prints the bare name when it has none
        sys.exit(f"{CC} has no libasan.so: install gcc's AddressSanitizer runtime (Debian: libgcc-12-dev)")
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0",
        "UBSAN_OPTIONS": "print_stacktrace=1",
        "PYTHONMALLOC": "malloc",
    }


def check_canary(env: dict) -> None:
    """Each canary case must stop a child with the sanitizer's report."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "canary.c"
        source.write_text(CANARY)
        path = build(source, "canary")
    for call, report in CANARY_CASES.items():
        code = f"from fuzz.sanitized import load; load('canary', {str(path)!r}).{call}"
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        if done.returncode == 0 or report not in done.stderr:
            sys.exit(f"canary {call} was not caught (exit {done.returncode}):\n{done.stderr[-3000:]}")
        print(f"canary: {call} caught ({report}, exit {done.returncode})", flush=True)


def load(name: str, path: str):
    """The extension module at ``path``, imported as ``name`` (in ``sys.modules``, before anyone imports it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def child(path: str, runs: int, seed: int, directories: list[str]) -> None:
    """In the sanitized child: ``path`` as ``router_proxy._rowscan``, then ``runs`` inputs through the target."""
    module = load("router_proxy._rowscan", path)
    import router_proxy

    router_proxy._rowscan = module
    from fuzz import fuzz_proxy_audit
    from router_proxy import candidate_scan

    if candidate_scan._rowscan is not module or candidate_scan.SCANNER != "c":
        sys.exit(f"the sanitized scanner is not the one in use: {candidate_scan._rowscan!r}")
    print(f"sanitized scanner: {module.__file__}", flush=True)
    inputs = fuzz_proxy_audit.seeds() + [bytes([0]) + fuzz_proxy_audit.valid_body("generate", "selected", 1100, 0)]
    inputs += [f.read_bytes() for d in directories for f in sorted(Path(d).iterdir()) if f.is_file()]
    rng, last = random.Random(seed), BUILD / "last-input"
    started = time.perf_counter()
    for _ in range(runs):
        data = rng.choice(inputs)
        for _ in range(rng.randint(1, 4)):
            data = (rng.random() < 0.5 and fuzz_proxy_audit.mutate_structure(data, rng)) or mutate_bytes(data, rng)
        last.write_bytes(data)
        fuzz_proxy_audit.TestOneInput(data)
    print(f"ran {runs} inputs through the target in {time.perf_counter() - started:.1f} s, no finding", flush=True)


# Bytes a hostile upstream might put anywhere in the candidate rows (tests/router_proxy/test_audit.py's EDITS).
EDITS = [b" ", b"0", b"9", b"-", b"+", b".", b"e", b"E", b",", b"[", b"]", b"n", b'"', b"null", b"1e999"]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One byte edit, half of them at or after the candidate rows' key where there is one."""
    start = data.find(b'"output_top_logprobs"') if rng.random() < 0.5 else 0
    at = rng.randrange(max(start, 0), len(data) + 1)
    edit = rng.choice(["set", "cut", "insert", "truncate"])
    if edit == "set" and at < len(data):
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    if edit == "cut":
        return data[:at] + data[at + rng.randint(1, 64) :]
    if edit == "insert":
        return data[:at] + (rng.choice(EDITS) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 16))) + data[at:]
    return data[:at]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.sanitized", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--canary",
        action="store_true",
        help="first check that the set-up catches a heap over-read and a signed overflow",
    )
    parser.add_argument("--runs", type=int, default=2000, help="inputs through the target (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="the inputs' random seed (default 0)")
    parser.add_argument("corpus", nargs="*", help="corpus directories whose files join the seeds")
    args = parser.parse_args(argv)
    env = environment()
    if args.canary:
        check_canary(env)
    path = build(SOURCE, "_rowscan")
    cmd = [sys.executable, "-m", "fuzz.sanitized", "--child", str(path), str(args.runs), str(args.seed), *args.corpus]
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    else:
        sys.exit(main(sys.argv[1:]))
