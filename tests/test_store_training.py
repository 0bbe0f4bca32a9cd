"""Training from a store in one's own loop: the guide's plain PyTorch loop over `StoreBatches` and
`load_store_suffix` ends with the weights of `preinfer train --store` over the same batches."""

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipelines.cli import main
from pipelines.store_training import StoreBatches
from tests.helpers.training_runs import assert_close, cache_and_model, weights

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "pre-inference.md"
SECTION = "## Training from a store in your own loop"


def guide_loop() -> str:
    """The python block of the guide's section."""
    section = GUIDE.read_text().split(SECTION, 1)[1]
    return re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)


def guide_command() -> list[str]:
    """The `preinfer train --store` command the section says the loop equals."""
    section = GUIDE.read_text().split(SECTION, 1)[1]
    return re.search(r"`preinfer (train --store [^`]*)`", section).group(1).split()


@pytest.mark.slow
def test_the_guide_s_loop_ends_as_train_from_the_store(tmp_path, corpus, monkeypatch):
    cache_and_model(tmp_path, corpus)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(guide_loop(), str(GUIDE), "exec"), namespace)
    assert main([*guide_command(), "--out", "run"]) == 0
    trained = {name: tensor for name, tensor in namespace["suffix"].model.state_dict().items() if not tensor.is_meta}
    reference = weights(str(tmp_path / "run"))
    assert set(reference) <= set(trained) and any(name.startswith("model.layers.2.") for name in reference)
    assert_close(reference, trained)
    initial = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert not initial["model.layers.2.mlp.up_proj.weight"].equal(trained["model.layers.2.mlp.up_proj.weight"])
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    assert [r["block"] for r in steps] == [0] * 5  # one block above the boundary, five steps
    position = json.loads((tmp_path / "position.json").read_text())
    resumed = StoreBatches("cache", batch_size=4, seed=0)
    resumed.load_state_dict(position)
    fresh = StoreBatches("cache", batch_size=4, seed=0)
    expected = [batch for _, batch in zip(range(6), fresh)][5]
    assert next(iter(resumed))["hidden"].equal(expected["hidden"])  # the sixth batch, where the loop stopped
