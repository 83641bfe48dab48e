# The two commands of the README. Both set up everything on a fresh machine first.
#   make run   the main job on the embedded defaults
#   make test  the whole test suite (CI runs exactly this, see .ci/run)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test setup docs clean

setup: $(STAMP)

# torch first, pinned to the CPU build on this disk: anything that depends on torch would
# otherwise pull a multi-GB CUDA build. sglang is installed without its GPU dependencies:
# the tests load its request types by file path as a protocol referee.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps sglang==0.5.23
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/centerline up

# pytest exits 5 when it collected no tests; that must fail, never pass silently.
test: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/python -m pytest -q -p no:cacheprovider; status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make test: pytest ran no tests" >&2; exit 1; fi; exit $$status

docs: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
