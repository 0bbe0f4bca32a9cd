"""The fuzzer over the whole config (issue 48): hypothesis draws configs over every key of every section
(`tests/helpers/config_fuzz.py`) on tiny models; each one trains to the end with finite losses, resumes bit for bit
after a SIGTERM at a drawn step and exports weights transformers loads, or is refused in one line, exit 2, before
any model loads, with nothing left in --out. CI runs a fixed budget from a fixed seed (derandomized); `make fuzz`
runs `FUZZ_EXAMPLES` (default 2000) from `FUZZ_SEED`."""

import os

import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from tests.helpers.config_fuzz import check, configs

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "24"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))
BUDGET = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="FUZZ_SEED" not in os.environ,
                  suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@pytest.mark.timeout(3600 * 12)
@seed(SEED)
@BUDGET
@given(config=configs(), stop_step=st.integers(1, 5))
def test_every_generated_config_trains_and_resumes_or_is_refused_in_one_line(config, stop_step, corpus,
                                                                             tmp_path_factory, capsys, monkeypatch):
    event(check(config, corpus, tmp_path_factory.mktemp("fuzz"), stop_step, capsys, monkeypatch))
