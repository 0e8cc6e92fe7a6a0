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
# CPU-only machine: `make install TORCH_INDEX=<url>`, <url> being PyTorch's CPU wheel index
# (see pytorch.org's install selector, "Pip" + "CPU"), installs torch and torchvision's CPU
# wheels from it first (the same pinned versions, local label +cpu), so pip never fetches
# the ~3.2 GB of CUDA libraries; everything else then comes from the default index. Use it
# on a fresh .venv (an installed CUDA torch already satisfies the pin). Empty: PyPI's torch.
TORCH_INDEX ?=

.PHONY: demo test install bench docs flwr-home clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH_INDEX),$(PIP) install -q --no-deps -c constraints.txt --index-url $(TORCH_INDEX) torch torchvision)
	$(PIP) install -q -c constraints.txt -e ".[simulation,deploy,mnist,vision,test,docs]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dpfl simulate --clients 4

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(VENV)/bin/python bench/dpsgd_throughput.py

# The documentation site into site/ (warnings are errors); `.venv/bin/mkdocs serve` to browse.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# A Flower config for plain `flwr run .` (export FLWR_HOME=$$PWD/.flwr first).
flwr-home:
	mkdir -p .flwr && cp deploy/flwr-config.toml .flwr/config.toml

clean:
	rm -rf runs .flwr site
