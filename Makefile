# Two commands cover a newcomer's set-up:  `make demo`  and  `make test`.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: docs install install-dev lint browser emulator demo test clean

# What the demo and the commands need: torch, mlflow, ONNX Runtime, LiteRT (DFlare's reference models
# are TFLite), scikit-learn, ...
install: $(STAMP)
# What the test suite and the docs need besides: Ray, OpenVINO, NNCF, pytest, LiteRT, ART, Selenium, MkDocs, ...
install-dev: $(DEV_STAMP)

# torch first, pinned: `pip install torch==2.13.0` takes the local CPU wheel, and the
# constraints file keeps every later step from asking for another torch (which would pull
# several GB of CUDA packages).
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV): pip, then the CPU build of torch 2.13.0, then mlflow-di (1-3 minutes)"
	$(PY) -m pip install --progress-bar off --upgrade pip
	$(PY) -m pip install --progress-bar off torch==2.13.0
	$(PY) -m pip install --progress-bar off -c constraints.txt -e ".[tflite]"
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "installing the test and docs extras into $(VENV) (Ray, OpenVINO, NNCF, pytest, LiteRT, ART, Selenium, MkDocs; 1-3 minutes)"
	$(PY) -m pip install --progress-bar off -c constraints.txt -e ".[dev]"
	touch $(DEV_STAMP)

# Train and register the digits CNN, then run the shipped policy on the version just registered
# (mlflow-di demo alone does the same in one command, with the same settings).
demo: install
	@echo "mlflow-di demo --train-only"
	@PYTHONUNBUFFERED=1 bash -o pipefail -c '$(VENV)/bin/mlflow-di demo --train-only | tee $(VENV)/.demo-train.log'
	@uri="$$(sed -n 's/^registered \(models:[^ ]*\) .*/\1/p' $(VENV)/.demo-train.log)"; \
		echo; echo "mlflow-di pipeline --policy examples/policies/demo.yaml --model-uri $$uri"; \
		$(VENV)/bin/mlflow-di pipeline --policy examples/policies/demo.yaml --model-uri "$$uri"

# The browser test drives Debian's Chromium; install it where we may (root with apt-get),
# otherwise that one test skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium + chromium-driver for the browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
		|| echo "could not install chromium: the browser test will be skipped"; \
	else echo "chromium not installed (needs root + apt-get): the browser test will be skipped"; fi

# qemu-user runs ONNX Runtime on an emulated x86 CPU without VNNI (tests/test_int8_host.py: int8 kernels that
# saturate), whatever CPU this machine has; without it that one test skips and says why.
emulator:
	@if command -v qemu-x86_64 >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing qemu-user for the int8-saturation test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null) \
		|| echo "could not install qemu-user: the emulated-CPU test will be skipped"; \
	else echo "qemu-user not installed (needs root + apt-get): the emulated-CPU test will be skipped"; fi

test: install-dev lint browser emulator docs
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# ruff (config in pyproject.toml): undefined and unused names, bare excepts, lines over 130 characters.
lint: install-dev
	$(VENV)/bin/ruff check .

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or reference fails.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) build *.egg-info
