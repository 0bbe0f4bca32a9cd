"""Mixed precision: 16-bit resident weights, fp32 masters / gradients / Adam state for the active block only
(invariant 9), loss scaling under fp16, exact resume mid-visit, the meter's accounting, dtypes on disk."""

import json
from typing import get_args
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipelines.cli import main
from pipelines.models import load_model, resolve_model
from preinfer.config import Config, dump_toml, load_config
from preinfer.config.choices import Precision as RequestedPrecision
from preinfer.errors import CheckpointError, UsageError
from preinfer.memory.meter import MemoryMeter
from preinfer.metrics import StepRecord, read_metrics
from preinfer.precision import LossScaler, Precision, resolve_precision
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from tests.helpers.trainers import make_trainer, snapshot

MIXED = dict(run__precision="bf16-mixed", optim__lr=1e-2)


def test_resolve_precision_follows_the_weights_and_refuses_unknown_values():
    assert resolve_precision("auto", torch.float32) == "fp32"
    assert resolve_precision("auto", torch.bfloat16) == "bf16-mixed"
    assert resolve_precision("auto", torch.float16) == "fp16-mixed"
    assert resolve_precision("fp32", torch.bfloat16) == "fp32"
    with pytest.raises(UsageError, match="--precision 'bf16' is not one of auto, fp32, bf16-mixed, fp16-mixed"):
        resolve_precision("bf16", torch.float32)


def test_the_resolved_precision_is_one_object_the_trainer_reads_without_resolving_again():
    """The run path resolves `run.precision` once; the trainer given the result neither resolves nor casts."""
    resolved = resolve_precision("auto", torch.float16)
    assert resolved is Precision.FP16_MIXED and resolved == "fp16-mixed" and json.dumps(resolved) == '"fp16-mixed"'
    assert (resolved.resident_dtype, resolved.mixed, resolved.loss_scaling) == (torch.float16, True, True)
    assert (Precision.FP32.mixed, Precision.BF16_MIXED.loss_scaling) == (False, False)
    assert {"auto", *Precision} == set(get_args(RequestedPrecision))  # the config's choices: these and auto
    given = make_trainer(run__precision="fp32")
    Precision.BF16_MIXED.apply(given.staged.model)
    again = type(given)(given.staged, given.partition, given.config, given.visit_sources,
                        precision=Precision.BF16_MIXED)
    assert again.precision is Precision.BF16_MIXED and again.scaler.enabled is False
    assert all(p.dtype == torch.bfloat16 for p in again.staged.model.parameters())  # not cast back to fp32


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_resident_weights_are_the_masters_cast_down_and_frozen_weights_never_change(preset):
    """Invariant 9 after every step of every visit, the tied GPT-2 embedding included (without expansion, which
    invariant 18 lets change the layers above the block: tests/test_expansion.py)."""
    checked = []
    trainer = make_trainer(preset, **MIXED, blocks__expand="none")
    model = trainer.staged.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    before = snapshot(model)
    visited: set[int] = set()

    def check(record):
        if not isinstance(record, StepRecord):
            return
        active = trainer.visit.active
        assert all(m.dtype == torch.float32 for m in active.masters)
        for param, master in zip(active.params, active.masters):
            assert torch.equal(param, master.to(torch.bfloat16))
        mine = {id(p) for p in active.params}
        visited.update(mine)
        for name, param in model.named_parameters():
            if id(param) not in visited:
                assert torch.equal(param, before[name]), f"frozen {name} changed"
        assert all(p.grad is None for p in model.parameters())  # the 16-bit gradients went into the masters
        checked.append(record.step)

    trainer.on_record = check
    trainer.fit()
    assert checked == list(range(1, 10))
    assert trainer.visit is None
    after = snapshot(model)
    for block in trainer.partition.blocks:
        assert any(not torch.equal(before[n], after[n]) for n, p in model.named_parameters()
                   if any(p is q for q in block.params))


def test_meter_under_bf16_mixed_is_exact_against_tensor_sizes():
    trainer = make_trainer(**MIXED, stop__steps_per_visit=2, blocks__expand="none")  # the block's tensors alone
    trainer.meter = MemoryMeter(trainer.staged.model)
    trainer.fit()
    every = sum(p.numel() for p in trainer.staged.model.parameters())
    for visit, block in zip(trainer.position.visits, trainer.partition.blocks):
        memory, active = visit["memory"], sum(p.numel() for p in block.params)
        assert memory["params"] == 2 * every
        assert memory["masters"] == memory["grads"] == 4 * active
        assert memory["optimizer"] == 8 * active + 4 * len(block.params)  # Adam's moments and step counters
        assert memory["masters"] + memory["grads"] + memory["optimizer"] == 16 * active + 4 * len(block.params)


def test_fp16_mixed_skips_a_step_with_infinite_gradients_and_counts_it(tmp_path):
    trainer = make_trainer(run_dir=tmp_path / "run", run__precision="fp16-mixed", stop__steps_per_visit=6,
                           blocks__blocks=1)
    model = trainer.staged.model
    assert all(p.dtype == torch.float16 for p in model.parameters())
    trainer.scaler.scale = 2.0**20  # the scaled loss's gradients overflow fp16 on the first step
    before = snapshot(model)
    trainer.fit()
    steps = [r for r in read_metrics(RunDir(tmp_path / "run").metrics) if isinstance(r, StepRecord)]
    skipped = [r.skipped_steps for r in steps]
    assert skipped[0] == 1 and skipped == sorted(skipped)
    assert [r.loss_scale for r in steps] == [2.0**20 / 2**n for n in skipped]  # halved per skip
    assert skipped[-1] < len(steps)  # once the scale came down, steps updated the weights
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_skipped_fp16_step_leaves_every_weight_unchanged():
    trainer = make_trainer(run__precision="fp16-mixed", stop__steps_per_visit=1, blocks__blocks=1)
    trainer.scaler.scale = float("inf")
    before = snapshot(trainer.staged.model)
    trainer.fit()
    assert trainer.scaler.skipped == 1
    after = snapshot(trainer.staged.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_loss_scaler_steps_as_torch_amp_grad_scaler_and_counts_the_steps_it_skips():
    """Growth interval 2: two finite steps double the scale; a step with an infinite gradient is skipped (the
    weight stays), halves the scale and restarts the count: GradScaler's own schedule over the same gradients."""
    ours, theirs = LossScaler(scale=8.0, growth_interval=2), torch.amp.GradScaler("cpu", 8.0, growth_interval=2)
    mine, reference = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    sgd, reference_sgd = torch.optim.SGD([mine], lr=0.1), torch.optim.SGD([reference], lr=0.1)
    seen = []
    for factor in (1.0, 2.0, float("inf"), 1.0):
        before = mine.detach().clone()
        ours.scale_loss(mine.sum() * factor).backward()
        ours.unscale_(sgd)
        stepped = ours.step(sgd)
        theirs.scale(reference.sum() * factor).backward()
        theirs.unscale_(reference_sgd)
        theirs.step(reference_sgd)
        theirs.update()
        sgd.zero_grad()
        reference_sgd.zero_grad()
        assert torch.equal(mine, reference)
        seen.append((stepped, ours.scale, theirs.get_scale(), ours.skipped, torch.equal(mine, before)))
    assert seen == [(True, 8.0, 8.0, 0, False), (True, 16.0, 16.0, 0, False), (False, 8.0, 8.0, 1, True),
                    (True, 8.0, 8.0, 1, False)]
    assert ours.state_dict() == {"scale": 8.0, "growth_interval": 2, "good_steps": 1, "skipped": 1}


def test_loss_scaler_state_is_plain_numbers_that_load_back_and_a_bad_one_is_refused():
    """The checkpoint's keys are those written before GradScaler (scale, growth interval, good steps, skipped)."""
    state = {"scale": 1024.0, "growth_interval": 2000, "good_steps": 7, "skipped": 3}
    scaler = LossScaler()
    scaler.load_state_dict(json.loads(json.dumps(state)))
    assert scaler.state_dict() == state and scaler.grad_scaler.state_dict()["_growth_tracker"] == 7
    for bad in ({**state, "good_steps": "7"}, {"scale": 1024.0}, {**state, "extra": 1}, [1024.0]):
        with pytest.raises(CheckpointError, match="loss_scaler = .*: expected numbers scale, growth_interval"):
            LossScaler().load_state_dict(bad)


def test_full_mode_under_bf16_mixed_has_masters_of_everything():
    trainer = make_trainer(**MIXED, blocks__blocks=1, stop__steps_per_visit=2)
    seen = []
    trainer.on_record = lambda r: seen.append(len(trainer.visit.active.masters)) if isinstance(r, StepRecord) else None
    trainer.fit()
    assert seen == [len(list(trainer.staged.model.parameters()))] * 2


@pytest.mark.slow
def test_a_bf16_directory_loads_as_bf16_trains_bf16_mixed_and_exports_bf16(tmp_path, capsys):
    model_dir = tmp_path / "bf16"
    build_preset("tiny-llama", seed=2).to(torch.bfloat16).save_pretrained(model_dir)
    assert load_model(str(model_dir)).model.embed_tokens.weight.dtype == torch.bfloat16
    out = tmp_path / "run"
    code = main(["bcd", "--model", str(model_dir), "--tokenizer", "byte", "--seq-len", "32", "--batch-size", "4",
                 "--steps-per-visit", "2", "--eval-tokens", "128", "--max-samples", "16", "--blocks", "2",
                 "--out", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()  # the tokenizer's two lines, then the precision's
    assert lines[0].startswith("tokenizer: byte (given by --tokenizer") and "precision: bf16-mixed" in lines[2]
    exported = AutoModelForCausalLM.from_pretrained(out / "export")
    assert exported.dtype == torch.bfloat16
    current = resolve_model(str(out))
    assert all(torch.equal(a, b) for a, b in zip(exported.parameters(), current.parameters()))
    assert {t.dtype for t in load_file(str(out / "checkpoint" / "model.safetensors")).values()} == {torch.bfloat16}


def test_fp32_precision_of_a_bf16_directory_trains_in_fp32(tmp_path, capsys):
    model_dir = tmp_path / "bf16"
    build_preset("tiny-llama", seed=2).to(torch.bfloat16).save_pretrained(model_dir)
    out = tmp_path / "run"
    assert main(["bcd", "--model", str(model_dir), "--tokenizer", "byte", "--precision", "fp32", "--seq-len", "32",
                 "--batch-size", "4", "--steps-per-visit", "1", "--eval-tokens", "128", "--max-samples", "16",
                 "--blocks", "1", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("precision: fp32")
    assert {t.dtype for t in load_file(str(out / "checkpoint" / "model.safetensors")).values()} == {torch.float32}


def test_a_bad_precision_is_one_line_with_exit_2_and_no_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as flag:
        main(["bcd", "--model", "tiny-llama", "--precision", "bf16", "--out", str(out)])
    assert flag.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--precision" in err
    config = tmp_path / "run.toml"
    config.write_text('[run]\nprecision = "half"\n')
    assert main(["bcd", "--config", str(config), "--model", "tiny-llama", "--out", str(out), "--max-samples", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[run] precision = 'half': expected one of auto, fp32, bf16-mixed, fp16-mixed" in err
    assert not out.exists()


def test_the_config_key_is_written_and_read_back(tmp_path):
    config = Config()
    config.run.precision = "fp16-mixed"
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(config))
    assert load_config(path).run.precision == "fp16-mixed"
    assert json.loads(json.dumps(config.to_dict()))["run"]["precision"] == "fp16-mixed"


def _bucket_rank(rank: int, init_file: str, results: str) -> None:
    """One gloo rank: gradients made ready in a rank-specific order, summed by buckets of a few tensors."""
    import torch.distributed as dist

    from preinfer.grad_buckets import BucketedAllReduce

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    sizes = [5, 300, 17, 64, 1, 250, 33]
    tensors = [torch.zeros(n) for n in sizes]
    reducer = BucketedAllReduce(tensors, bucket_bytes=4 * 320)  # several buckets, one tensor larger than most
    order = list(range(len(sizes))) if rank == 0 else [3, 6, 0, 5, 2, 1, 4]
    for step in range(2):
        for index, tensor in enumerate(tensors):
            tensor.grad = None if index == 4 else torch.randn(sizes[index], generator=torch.Generator().manual_seed(
                100 * step + 10 * index + rank))
        reducer.start_step()
        for index in order:
            if index != 4:  # a tensor that never got a gradient is summed as zeros
                reducer.grad_ready(index)
        reducer.finish()
        expected = [torch.zeros(n) if i == 4 else sum(
            torch.randn(n, generator=torch.Generator().manual_seed(100 * step + 10 * i + r)) for r in (0, 1))
            for i, n in enumerate(sizes)]
        assert len(reducer.buckets) > 2
        assert all(torch.equal(t.grad, e) for t, e in zip(tensors, expected)), (rank, step)
    # the fused step's hand-over: each tensor once, summed, the buckets before the last launched during backward
    handed = {}
    stepping = BucketedAllReduce(tensors, bucket_bytes=4 * 320,
                                 on_reduced=lambda i: handed.setdefault(i, tensors[i].grad.clone()))
    for index in reversed(range(len(sizes))):  # backward's order: bucket 0 first
        tensors[index].grad = torch.full((sizes[index],), float(index + rank))
        stepping.grad_ready(index)
    during_backward = set(handed)
    stepping.finish()
    assert during_backward and set(handed) == set(range(len(sizes))) and len(during_backward) < len(sizes)
    assert all(torch.equal(handed[i], torch.full((n,), 2.0 * i + 1)) for i, n in enumerate(sizes))
    Path(results, str(rank)).write_text("ok")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_bucketed_all_reduce_sums_exactly_whatever_order_the_gradients_complete_in(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_bucket_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "0").read_text() == (tmp_path / "1").read_text() == "ok"


def test_recompute_under_bf16_mixed_gives_the_same_weights():
    runs = []
    for recompute in (False, True):
        trainer = make_trainer(**MIXED, run__recompute=recompute, stop__steps_per_visit=2)
        trainer.fit()
        runs.append(snapshot(trainer.staged.model))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_pre_inference_stores_take_the_bf16_compute_dtype(tmp_path, corpus):
    out = tmp_path / "run"
    assert main(["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--batch-size", "4",
                 "--steps-per-visit", "2", "--blocks", "2", "--eval-tokens", "128", "--pre-inference", "on",
                 "--keep-stores", "--precision", "bf16-mixed", "--out", str(out)]) == 0
    manifests = sorted((out / "stores").glob("*/train/manifest.json"))
    assert manifests
    for manifest in manifests:
        assert json.loads(manifest.read_text())["fields"]["hidden"]["dtype"] == "bfloat16"
