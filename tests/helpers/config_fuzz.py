"""A hypothesis strategy over the whole run config (issue 48's fuzzer): every key of every section of
`preinfer.config.Config`, drawn from its type (a Literal's choices, booleans, small numbers around each bound, a
few values of the wrong type) with domain values where a key names something (paths, rates, layer ranges), on a
tiny model and corpus; and the contract one generated config is held to (`check`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from pathlib import Path
from typing import Any, Literal, get_origin

import torch
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import preinfer.trainer
from pipelines.cli import main
from preinfer.config import Config
from preinfer.config.choices import choices_of, field_hint, is_names, is_optional
from preinfer.metrics import VisitRecord, read_metrics
from preinfer.run_dir import RunDir
from tests.helpers.cli_run import failure_line
from tests.helpers.composition import ModelBuilds

SKIPPED = {"run.out", "data.path", "run.device", "data.token_store", "pre_inference.store_dir", "store.path",
           "pre_inference.dask", "model.chat_template", "model.chat_template_name",  # set by the harness or need a service
           "model.masters"}  # disk needs a model directory, and every model here is a preset (tests/test_disk_masters.py)
NUMBERS = ([0, 1, 2, 3, 0.5, 1e-3, 2.0], [-2, -1.0, 1e40, math.inf])

# key: (valid values, invalid ones); a set key takes an invalid value with chance `BAD`
DOMAIN: dict[str, tuple[list, list]] = {
    "model.name": (["tiny-llama", "tiny-llama", "tiny-gpt2", "tiny-moe"], ["no-such-model"]),
    "model.tokenizer": (["auto", "byte"], ["/no/such/tokenizer"]),
    "data.seq_len": ([8, 16], [0]),
    "data.batch_size": ([1, 2, 4], [0]),
    "data.eval_tokens": ([64, 0], [-1]),
    "data.eval_fraction": ([0.1, 0.3], [1.0, -0.5]),
    "data.max_samples": ([0, 24], [-1]),
    "data.samples_per_shard": ([0, 8], [-1]),
    "data.dataset_split": (["train"], ["bad split"]),
    "blocks.ufp": (["1/2", "1/3", "auto"], ["2", "x"]),
    "blocks.memory_budget": ([4 << 20], [0]),
    "blocks.gpu": (["4090"], ["h9000"]),
    "blocks.blocks": ([1, 2, 3], [0]),
    "blocks.ranges": (["0-1,2-3"], ["0-5", "x"]),
    "blocks.fixed_order": (["1,0"], ["x"]),
    "blocks.start_block": ([0, 1], [-1]),
    "blocks.active": (["1-2"], ["9-9"]),
    "blocks.experts": (["top:0.5"], ["top:2"]),
    "blocks.experts_sample": ([1, 2], [0]),
    "blocks.importance_batches": ([1, 2], [0]),
    "blocks.importance_floor": ([1, 2], [0]),
    "blocks.expand_rank": ([2, 8, 64], [0, 65, 10**6]),  # the tiny models' widest narrow side is 64
    "blocks.expand_lr": ([1e-3], [0.0, 1e40]),
    "blocks.sweeps": ([1, 2], [0]),
    "optim.lr": ([1e-3, 1e-2], [0.0, 1e40]),
    "optim.betas": ([[0.9, 0.95], [0.8, 0.99]], [[0.9, 1.5], [0.9]]),
    "optim.momentum": ([0.0, 0.9], [-1.0]),
    "optim.weight_decay": ([0.0, 0.01], [-1.0]),
    "optim.warmup_steps": ([0, 1], [-1]),
    "optim.warmup_ratio": ([0.0, 0.5], [1.5]),
    "optim.grad_clip": ([0.0, 1.0], [-1.0]),
    "optim.block_lr": (["depth:0.5..1.5", "1,0.5"], ["1e308,1e308", "depth:1..1e300", "x"]),
    "optim.grad_accum": ([1, 2], [0]),
    "stop.steps_per_visit": ([1, 2, 3], [0]),
    "stop.epochs_per_visit": ([0.1], [0.0]),
    "stop.patience": ([2], [0]),
    "stop.min_delta": ([0.0, 0.01], [-1.0]),
    "stop.smoothing": ([0.5, 0.9], [1.0]),
    "stop.gain_window": ([1, 2], [0]),
    "stop.total_steps": ([3, 5], [0]),
    "run.checkpoint_every": ([0, 2], [-1]),
    "run.pipeline": ([1], [2]),
    "run.microbatches": ([0, 2], [-1]),
    "run.report_to": (["none", "tensorboard"], ["nope"]),
    "run.seed": ([0, 1, -3], []),
}
BAD = 0.03
SET = 0.3
PERCENT = st.sampled_from(range(100))  # drawn uniformly (integers' and floats' draws favour their bounds)


def values(section: type, key: str) -> tuple[list, list]:
    """A key's (valid, invalid) values: its domain's, or from its type (a Literal's choices, booleans)."""
    hint = field_hint(section, key)
    if is_names(hint) or get_origin(hint) is Literal:
        return list(choices_of(hint)), ["not-a-choice"]
    if hint is bool:
        return [False, True], ["yes"]
    if hint in (int, float):
        return NUMBERS
    return ["x"], []


@st.composite
def configs(draw) -> dict[str, dict[str, Any]]:
    """A config as its TOML file holds it: {section: {key: value}}; each key is left unset (its default) with chance
    1 - `SET`, else drawn from its valid values, or with chance `BAD` from its invalid ones."""
    drawn: dict[str, dict[str, Any]] = {}
    for section in dataclasses.fields(Config):
        cls = type(getattr(Config(), section.name))
        for item in dataclasses.fields(cls):
            key = f"{section.name}.{item.name}"
            if key in SKIPPED or 100 - draw(PERCENT) > 100 * SET:  # shrinks towards unset
                continue
            good, bad = DOMAIN.get(key) or values(cls, item.name)
            pool = bad if bad and draw(PERCENT) >= 100 * (1 - BAD) else good
            drawn.setdefault(section.name, {})[item.name] = draw(st.sampled_from(pool))
    drawn.setdefault("stop", {}).setdefault("steps_per_visit", 2)  # short runs unless drawn otherwise
    drawn.setdefault("data", {}).setdefault("seq_len", 16)
    drawn["data"].setdefault("eval_tokens", 64)
    drawn.setdefault("model", {}).setdefault("name", "tiny-llama")
    return drawn


def toml(config: dict[str, dict[str, Any]]) -> str:
    """The TOML text of `config` (JSON's scalars are TOML's, but for infinity and booleans)."""
    def scalar(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if isinstance(value, list):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        return json.dumps(value)

    return "".join(f"[{section}]\n" + "".join(f"{k} = {scalar(v)}\n" for k, v in keys.items()) + "\n"
                   for section, keys in config.items())


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(RunDir(out).checkpoint_weights))


def bcd(arguments: list[str], capsys) -> tuple[int, str, bool]:
    capsys.readouterr()
    with ModelBuilds() as builds:
        try:
            code = main(arguments)
        except SystemExit as exit_:
            code = exit_.code
    return code, capsys.readouterr().err, builds.count > 0


def stop_at(steps: int):
    """`Trainer.emit` that sends this process SIGTERM after the `steps`-th step record."""
    emit, seen = preinfer.trainer.Trainer.emit, []

    def emitting(trainer, record):
        emit(trainer, record)
        if type(record).__name__ == "StepRecord":
            seen.append(record)
            if len(seen) == steps:
                os.kill(os.getpid(), signal.SIGTERM)
    return emitting


def check(config: dict[str, dict[str, Any]], corpus: str, tmp: Path, stop_step: int, capsys, monkeypatch) -> str:
    """Hold one generated config to the contract; returns "refused" or "trained":
    - refused: one line, exit 2, no model built, nothing in --out;
    - trained: finite eval losses; stopped by SIGTERM after `stop_step` steps and resumed, the same weights bit for
      bit; an export that transformers loads."""
    path = tmp / "config.toml"
    path.write_text(toml(config))
    out = tmp / "run"
    base = ["bcd", "--config", str(path), "--data", corpus, "--samples-per-shard", "8"]
    code, err, loaded = bcd([*base, "--out", str(out)], capsys)
    if code != 0:
        assert code == 2, (code, err[-3000:], toml(config))
        failure_line(err)
        assert not loaded, (err, toml(config))
        assert not out.exists() or not any(out.iterdir()), (err, toml(config))
        return "refused"
    visits = [r for r in read_metrics(RunDir(out).metrics) if isinstance(r, VisitRecord)]
    assert visits and all(math.isfinite(v.eval_loss) for v in visits), toml(config)
    steps = sum(v.steps for v in visits)
    AutoModelForCausalLM.from_pretrained(out / "export")
    if steps > stop_step:
        cut = tmp / "cut"
        monkeypatch.setattr(preinfer.trainer.Trainer, "emit", stop_at(stop_step))
        code, err, _ = bcd([*base, "--out", str(cut)], capsys)
        monkeypatch.undo()
        assert code == 143, (code, err[-3000:], toml(config))
        code, err, _ = bcd(["bcd", "--out", str(cut), "--resume"], capsys)
        assert code == 0, (code, err[-3000:], toml(config))
        a, b = weights(out), weights(cut)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), toml(config)
    return "trained"
