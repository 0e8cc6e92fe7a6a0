# dpfl: two commands on a fresh machine.
#   make demo   install (first time) and run the default private federation
#   make test   install (first time) and run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.dpfl-installed
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1

.PHONY: demo test install bench flwr-home clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[simulation,deploy,mnist,vision,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dpfl simulate --clients 4

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25 -n 2 --dist loadfile

bench: $(STAMP)
	$(VENV)/bin/python bench/dpsgd_throughput.py

# A Flower config for plain `flwr run .` (export FLWR_HOME=$$PWD/.flwr first).
flwr-home:
	mkdir -p .flwr && cp deploy/flwr-config.toml .flwr/config.toml

clean:
	rm -rf runs .flwr
