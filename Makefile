# Two commands cover a newcomer's set-up:  `make demo`  and  `make test`.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

install: $(STAMP)

# torch first, pinned: `pip install torch==2.13.0` takes the local CPU wheel, and the
# constraints file keeps every later step from asking for another torch (which would pull
# several GB of CUDA packages).
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/mlflow-di demo

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
