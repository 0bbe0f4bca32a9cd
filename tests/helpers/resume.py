"""A run halted mid-visit and resumed beside the same run uninterrupted."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.trainers import make_trainer, snapshot


def halted_and_resumed(tmp_path: Path, halt_at: int, **overrides):
    """The trainer of `make_trainer(**overrides)` run to the end, the tensors of the checkpoint (state.safetensors)
    of the same run halted after `halt_at` steps, and the trainer that resumed from that checkpoint and ran to the
    end."""
    reference = make_trainer(run_dir=tmp_path / "a", **overrides)
    reference.fit()
    make_trainer(run_dir=tmp_path / "b", **overrides).fit(max_total_steps=halt_at)
    saved = load_file(str(tmp_path / "b" / "checkpoint" / "state.safetensors"))
    resumed = make_trainer(run_dir=tmp_path / "b", **overrides)
    resumed.resume()
    resumed.fit()
    return reference, saved, resumed


def same_weights(a, b) -> bool:
    """Whether two trainers' models hold bit-identical parameters."""
    left, right = snapshot(a.staged.model), snapshot(b.staged.model)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
