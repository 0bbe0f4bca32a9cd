# The two commands of the README: `make demo` and `make test` (`make test-fast`: the tests marked neither slow nor
# distributed). All set up .venv first.
# Override the PyTorch requirement for another build, e.g. `make test TORCH='torch==2.5.1'`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-fast docs
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

demo: setup
	$(VENV)/bin/preinfer demo

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not distributed"

# The generated reference pages (docs/reference/): every command's flags, the config keys, the metrics records.
docs: setup
	$(PY) -m pipelines.reference
