# The two commands of the README: `make demo` and `make test` (`make test-fast`: the tests marked neither slow nor
# distributed). All set up .venv first.
# Override the PyTorch requirement for another build, e.g. `make test TORCH='torch==2.5.1'`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-fast fuzz docs constraints
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	touch $@

demo: setup
	$(VENV)/bin/preinfer demo

# Two pytest-xdist workers: most tests wait on a process of their own (a job, torchrun, a Dask cluster) or run
# single-threaded (tests/conftest.py), so two run side by side on two cores. pyproject's --dist loadscope sends a
# module's tests to one worker, which builds its module fixtures (a torchrun job, reference runs) once; xdist's
# loadgroup would be finer but reads no xdist_group under pytest 9 (it rewrites a node id pytest 9 no longer keeps).
test: setup
	$(PY) -m pytest -q -n 2

test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not slow and not distributed"

# The config fuzzer (tests/test_config_fuzz.py) longer than CI's 24 examples: FUZZ_EXAMPLES generated configs from
# FUZZ_SEED, each trained, stopped and resumed, or refused in one line (docs/reliability.md records the last run).
FUZZ_EXAMPLES ?= 2000
FUZZ_SEED ?= 4810
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q -x -p no:cacheprovider \
		--hypothesis-show-statistics tests/test_config_fuzz.py

# The generated reference pages (docs/reference/): every command's flags, the config keys, the metrics records.
docs: setup
	$(PY) -m pipelines.reference

# constraints.txt anew from the installed set (after a deliberate upgrade, e.g. `$(PY) -m pip install -U transformers`,
# and the tests passing on it).
constraints:
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v -i -E '^(torch|preinfer)=='; } > constraints.new
	mv constraints.new constraints.txt
