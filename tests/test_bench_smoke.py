"""Smoke tests of the benchmarks (`python -m bench.NAME`): `--quick --in-process` runs in seconds and writes the
expected JSON.

No timing assertions: only the JSON's shape and values that hold on any machine."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import finetune_runs, peer_loops, runs
from preinfer.config.rules import resolved_expand

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def _load(name: str):
    return importlib.import_module(f"bench.{name}")


def _imported(path: Path) -> set[str]:
    """The modules a file imports (`from bench import x` counts as `bench.x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def _is_script(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def test_every_benchmark_is_a_script_of_the_bench_package_and_imports_no_other():
    """Each bench/NAME.py runs as `python -m bench.NAME`; what two share lives in bench/lib, which holds no
    script; nothing under bench/ edits sys.path."""
    assert {"train", "peers", "finetune"} <= set(SCRIPTS)
    assert [name for name in SCRIPTS if not _is_script(BENCH / f"{name}.py")] == []
    library = sorted(p for p in (BENCH / "lib").glob("*.py"))
    assert library and [p.name for p in library if _is_script(p)] == []
    for path in [*BENCH.glob("*.py"), *library]:
        assert "sys.path" not in path.read_text(), path
        scripts = {module for module in _imported(path)
                   if module.startswith("bench.") and module.split(".")[1] in SCRIPTS}
        assert scripts == set(), path


def test_a_benchmark_runs_as_a_module_from_the_repository_root_only():
    """bench is not installed: `python -m bench.NAME` imports it from the working directory, the root."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "bench.chat_data", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "--out" in done.stdout, done.stderr
    elsewhere = subprocess.run([sys.executable, "-c", "import bench"], cwd=BENCH / "lib", env=env,
                               capture_output=True, text=True)
    assert "No module named 'bench'" in elsewhere.stderr


@pytest.mark.slow
def test_memory_quick(tmp_path):
    out = tmp_path / "memory.json"
    assert _load("memory").main(["--quick", "--in-process", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"command", "machine", "settings", "paper", "targets", "rows"} <= set(result)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"full", "live:1/2", "live:1/3", "live:1/4", "store:1/3",
                         "full+recompute", "live:1/3+recompute", "store:1/3+recompute"}
    full = rows["full"]
    assert full["ratio_tracked"] == 1.0
    # Full Adam: one block, gradients as big as the parameters, Adam's two moments (plus step counters).
    c = full["components"]
    assert c["grads"] == c["params"] and 2 * c["params"] <= c["optimizer"] < 2.01 * c["params"]
    for r in rows.values():
        assert r["tracked_peak"] == sum(r["components"].values())
        assert r["rss_peak"] > 0 and r["planner_total"] > 0
        assert abs(r["planner_error"]) < 0.15  # the planner's own acceptance bound
    for name in ("live:1/2", "live:1/3", "live:1/4", "store:1/3"):
        assert 0 < rows[name]["ratio_tracked"] < 1
    for name in ("full", "live:1/3", "store:1/3"):  # recomputation keeps fewer activations, nothing else changes
        plain, recomputed = rows[name]["components"], rows[name + "+recompute"]["components"]
        assert recomputed["activations"] < plain["activations"]
        assert {k: v for k, v in recomputed.items() if k != "activations"} == \
            {k: v for k, v in plain.items() if k != "activations"}
    assert rows["full+recompute"]["ratio_tracked_to_full_recompute"] == 1.0
    store, live = rows["store:1/3"], rows["live:1/3"]
    assert store["components"]["params"] < live["components"]["params"]  # the prefix is not resident
    assert all(v["source_boundary"] == v["start"] > 0 for v in store["visits"])
    assert store["tracked_peak"] < live["tracked_peak_above_0"]


@pytest.mark.slow
def test_quality_quick(tmp_path):
    out = tmp_path / "quality.json"
    assert _load("quality").main(["--quick", "--in-process", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"command", "machine", "settings", "rows", "epochs_ratio", "target", "runs", "plot"} <= set(result)
    assert Path(result["plot"]).is_file()
    rows = result["rows"]
    assert set(rows) == {"full-adam", "bcd-adam", "bcd-sgd"}
    budget = result["settings"]["budget_tokens"]
    for name, row in rows.items():
        assert math.isfinite(row["final_eval_loss"]) and row["final_ppl"] == math.exp(row["final_eval_loss"])
        assert row["tokens"] == budget
        curve = result["runs"][name]["curve"]
        assert curve[0]["tokens"] == 0 and curve[-1]["tokens"] == result["runs"][name]["tokens"]
    assert result["runs"]["bcd-adam"]["tokens"] == 2 * budget  # --bcd-adam-factor 2
    assert rows["full-adam"]["rel_to_full"] == 0


@pytest.mark.slow
def test_quality_until_plateau_stops_each_method_early(tmp_path):
    out = tmp_path / "quality.json"
    # A plateau tolerance of 100%: every run counts as plateaued once `window` evaluations follow its first.
    args = ["--quick", "--in-process", "--out", str(out), "--until-plateau", "--max-epochs", "0.01",
            "--plateau-rel", "1.0", "--plateau-window", "1"]
    assert _load("quality").main(args) == 0
    result = json.loads(out.read_text())
    cap = result["settings"]["budget_steps"]
    for name, row in result["rows"].items():
        run = result["runs"][name]
        assert run["steps"] == result["settings"]["eval_every"] < cap  # stopped at the first evaluation after 0
        assert row["final_eval_loss"] == min(c["eval_loss"] for c in run["curve"])  # compared at its best
    assert result["epochs_ratio"]["plateau_epochs"]["bcd_adam"] == 0  # the plateau began at the first point
    # --reuse takes every method's kept result (nothing trains again), but not after a setting changed
    quality = _load("quality")
    assert quality.main([*args, "--reuse"]) == 0
    assert json.loads(out.read_text())["runs"] == result["runs"]
    kept = (tmp_path / "quality_runs" / "full-adam.json").stat().st_mtime_ns
    assert quality.main([*args, "--reuse", "--plateau-window", "2"]) == 0
    assert (tmp_path / "quality_runs" / "full-adam.json").stat().st_mtime_ns != kept


@pytest.mark.slow
def test_train_quick(tmp_path):
    out = tmp_path / "train.json"
    assert _load("train").main(["--quick", "--out", str(out), "--dir", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())
    assert {"command", "machine", "settings", "targets", "throughput", "pieces", "achieved_over_ideal", "bcd",
            "targets_met"} <= set(result)
    t, p = result["throughput"], result["pieces"]
    assert t["boundary"] == 3 and t["active"] == "3-3"  # tiny-llama: 4 layers, the top block of UFP 1/3
    for name in ("live", "store"):
        assert all(r["steps"] == 3 and r["steps_per_s"] > 0 for r in t["runs"][name])
    assert t["max_rel_loss_diff"] < 1e-5  # the same samples in the same order, live and from the store
    assert 0 <= t["wait_fraction"] <= 1 and t["store"]["stored_MiB"] > 0
    assert p["ideal"] > 1 and p["prefix_s"] > 0 and p["suffix_s"] > 0
    b = result["bcd"]
    assert set(b["runs"]) == {"off", "auto"}
    assert all(d["decision"] in ("store", "live") for d in b["runs"]["auto"][0]["decisions"])
    assert b["max_rel_eval_loss_diff"] < 1e-4


@pytest.mark.slow
def test_train_store_dtypes_quick(tmp_path, corpus):
    """bench.train --store-dtype: the top block of a trained run from the exact and a lossy store."""
    from pipelines.cli import main

    run = tmp_path / "trained"
    assert main(["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--batch-size", "2",
                 "--steps-per-visit", "2", "--samples-per-shard", "8", "--eval-fraction", "0.2", "--eval-tokens",
                 "128", "--pre-inference", "off", "--out", str(run)]) == 0
    out = tmp_path / "out" / "train.json"
    assert _load("train").main(["--quick", "--store-dtype", "float8_e4m3", "--trained", str(run), "--dtype-steps",
                                "4", "--out", str(out), "--dir", str(tmp_path / "work")]) == 0
    result = json.loads((tmp_path / "out" / "train_store_dtypes.json").read_text())
    assert result["lr_decay"] == "cosine" and result["boundary"] == 3 and result["steps"] == 4
    assert [(r["seed"], r["dtype"]) for r in result["rows"]] == [(0, "float32"), (0, "float8_e4m3")]
    exact, lossy = result["rows"]
    assert exact["rel_eval_loss_diff"] == 0 and math.isfinite(lossy["final_eval_loss"])
    assert lossy["rel_eval_loss_diff"] != 0  # decoded states differ from the exact ones, so the weights do
    assert all(0 <= r["wait_fraction"] <= 1 for r in result["rows"])


def test_peers_long_visit_windows_take_the_plain_loop_over_the_same_seconds():
    """A trainer at 1 step/s against a plain pacer at 2 steps/s on the same clock: each window 0.5x; a pacer that
    does not cover the trainer's whole visit is an error."""
    peers = _load("peers")
    trainer = dict(stamps=[1.0, 2.0, 3.0, 4.0], times=[101.0, 102.0, 103.0, 104.0])  # the visit began at 100
    pacer = dict(times=[99.5 + 0.5 * i for i in range(13)])  # 2 steps/s from 99.5 to 105.5
    windows = peers.aligned_windows(trainer, pacer, 2, 10)
    assert [rate for pair in windows for rate in pair] == pytest.approx([10.0, 20.0, 10.0, 20.0])
    with pytest.raises(RuntimeError, match="not all of the trainer's visit"):
        peers.aligned_windows(trainer, dict(times=pacer["times"][:8]), 2, 10)


def peers_config(peers, args, tmp_path, name: str):
    """The config of one bench.peers method's run `name` under `tmp_path`, as the bench builds it."""
    return runs.parse_config(runs.bcd_flags(args, tmp_path / name, args.steps, args.ranges, args.seq_len,
                                              args.batch_size))


def test_peers_plain_loop_trains_like_preinfer_bcd_on_the_same_batches(tmp_path, corpus):
    peers = _load("peers")
    args = peers.parse_args(["--quick", "--data", corpus])

    config = functools.partial(peers_config, peers, args, tmp_path)

    from pipelines import training
    from preinfer.precision import apply_precision
    from preinfer.presets import build_preset

    plain = peer_loops.plain_worker(config("plain"))
    training.run(config("preinfer"), quiet=True)
    mine = runs.preinfer_result(tmp_path / "preinfer")
    initial = build_preset(args.model, seed=0)
    apply_precision(initial, args.precision)
    initial.save_pretrained(tmp_path / "initial")
    batches = peers.eval_batches(args, runs.bcd_flags(args, tmp_path / "x", 1, args.ranges, args.seq_len,
                                                       args.batch_size))
    losses = {name: runs.eval_loss(directory, batches)
              for name, directory in (("plain", plain["model_dir"]), ("preinfer", mine["model_dir"]),
                                      ("initial", str(tmp_path / "initial")))}
    # same blocks, batches, order and Adam: the same weights up to bf16 rounding; both trained
    assert abs(losses["plain"] / losses["preinfer"] - 1) < 1e-3
    assert losses["plain"] < losses["initial"] - 0.01
    assert plain["steps"] == mine["steps"] == 2 * args.steps
    assert plain["tracked_peak"] > 0 and mine["tracked_peak"] > 0
    assert mine["stamps"] == sorted(mine["stamps"][:args.steps]) + sorted(mine["stamps"][args.steps:])


@pytest.mark.slow
def test_peers_hf_trainer_row_trains_like_the_plain_loop_on_the_same_batches(tmp_path, corpus):
    """The `hf-trainer` row: preinfer.hf in transformers.Trainer, the same blocks, batches and Adam as `plain`."""
    peers = _load("peers")
    args = peers.parse_args(["--quick", "--data", corpus])

    config = functools.partial(peers_config, peers, args, tmp_path)

    plain, hf = peer_loops.plain_worker(config("plain")), peer_loops.hf_trainer_worker(config("hf"))
    batches = peers.eval_batches(args, runs.bcd_flags(args, tmp_path / "x", 1, args.ranges, args.seq_len,
                                                       args.batch_size))
    losses = [runs.eval_loss(run["model_dir"], batches) for run in (plain, hf)]
    assert abs(losses[1] / losses[0] - 1) < 1e-3
    assert hf["steps"] == plain["steps"] == 2 * args.steps and len(hf["stamps"]) == len(hf["times"])
    assert hf["tracked_peak"] > 0 and 0 < hf["train_s"] <= hf["stamps"][args.steps - 1] + hf["stamps"][-1] + 1e-9



@pytest.mark.slow
def test_trainer_overhead_times_each_method_s_steps_but_each_visit_s_first(tmp_path):
    """Every method of bench.trainer_overhead trains 2 blocks of 3 steps: 2 step times per visit, all positive."""
    overhead = _load("trainer_overhead")
    args = overhead.parse_args(["--steps", "3"])
    for method in overhead.METHODS:
        flags = runs.bcd_flags(args, tmp_path / method, args.steps, args.ranges, args.seq_len,
                                         args.batch_size)
        times = overhead.run(method, runs.parse_config(flags), flags, tmp_path / method)
        assert len(times) == 2 * (args.steps - 1) and min(times) > 0, method


def test_peers_every_method_runs_the_attention_of_attention(tmp_path, corpus):
    peers = _load("peers")
    args = peers.parse_args(["--quick", "--data", corpus, "--attention", "eager"])
    config = runs.parse_config(runs.bcd_flags(args, tmp_path / "run", 1, args.ranges, args.seq_len,
                                                args.batch_size))
    assert config.model.attention == "eager"  # preinfer's run
    model = runs.prepared(config)[0]  # plain's and badam's model
    assert model.config._attn_implementation == "eager"


def test_chat_data_writes_a_conversation_per_prose_section(tmp_path):
    out = tmp_path / "pydoc-chat.jsonl"
    assert _load("chat_data").main(["--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    from pydoc_data.topics import topics

    assert len(topics) < len(records)  # sections, not only topics
    for record in records:
        user, assistant = record["messages"]
        assert user["role"] == "user" and user["content"].startswith("What is ") and user["content"].endswith(
            " in Python?")
        assert assistant["role"] == "assistant" and len(assistant["content"]) >= 40
        assert "\n" not in assistant["content"] and not assistant["content"].startswith(" ")
    first = records[0]["messages"]
    assert first[0]["content"] == 'What is The "assert" statement in Python?'
    assert first[1]["content"] == " ".join(topics["assert"].split("\n\n")[1].split())


@pytest.mark.slow
def test_finetune_quick_compares_every_method_on_the_same_batches(tmp_path, monkeypatch):
    """bench.finetune --quick: every method trains 2 steps of tiny-llama on the chat task, and the JSON holds a
    row per method, the grid, the base losses, the curves and the speed section. BCD live, from stores and with
    pre-inference auto train the same blocks on the same batches with the same Adam and expansion: the same eval
    loss; BCD without expansion is BAdam's. BCD without expansion with frozen layers in bf16, int8 or nf4 (and
    nf4 with 8-bit Adam stepped in backward) lands close to that, at a smaller tracked peak the fewer the bits;
    QLoRA (LoRA r16 on an NF4 base) trains other weights than LoRA r16, at a smaller tracked peak."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    general = tmp_path / "general.txt"
    general.write_text("".join(f"Paragraph {i}: the fox ran over the hill and rested by the river.\n\n"
                               for i in range(40)))
    out = tmp_path / "finetune.json"
    finetune = _load("finetune")
    assert finetune.main(["--quick", "--in-process", "--general", str(general), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == set(finetune.METHODS) and {row["task"] for row in result["rows"]} == {"chat"}
    assert set(result["best_lr"]) == set(finetune.GRID_METHOD)
    base = result["base"]["chat"]
    for method, row in rows.items():
        assert row["eval_loss"] < base["eval_loss"], method  # each trained, its saved weights evaluated
        assert math.isfinite(row["general_loss"]) and row["tokens_per_s"] > 0 and row["tracked_peak_mib"] > 0
        assert row["curve"] and row["curve"][-1]["train_s"] <= row["train_s"] + 1e-6, method
    assert all(rows[m]["steps"] == 2 for m in METHODS_AT_EQUAL_STEPS)
    same = [rows[m]["eval_loss"] for m in ("bcd", "bcd-store", "bcd-auto")]  # the default expansion, lowrank
    assert max(same) - min(same) < 1e-4 * same[0]
    assert abs(rows["bcd-none"]["eval_loss"] - rows["badam"]["eval_loss"]) < 1e-4 * same[0]  # BAdam expands nothing
    assert rows["bcd-none"]["eval_loss"] != rows["bcd"]["eval_loss"]
    assert rows["lora8"]["eval_loss"] != rows["lora16"]["eval_loss"]
    for method in finetune_runs.LOW_BIT:  # the run without expansion, frozen layers in fewer bits: close, not equal
        assert abs(rows[method]["eval_loss"] / rows["bcd-none"]["eval_loss"] - 1) < 1e-2, method
    peaks = [rows[m]["tracked_peak_mib"] for m in ("bcd-none", "bcd-bf16", "bcd-int8", "bcd-nf4")]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]  # the meter counts the codes
    assert rows["qlora"]["eval_loss"] != rows["lora16"]["eval_loss"]  # trained against the NF4 base
    assert rows["qlora"]["tracked_peak_mib"] < rows["lora16"]["tracked_peak_mib"]
    assert [row["blocks"] for row in result["speed"]] == [2] and result["speed"][0]["x_lora16"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_finetune_lever_rows_parse_into_bcd_with_their_lever_at_the_same_step_count():
    """bench.finetune's issue-38 rows: each one's flags, by the real command line, are `bcd`'s with its lever, and
    the bcd-x4 rows spend the same steps in 4x the sweeps of a quarter the visit."""
    import argparse

    from bench.lib.runs import parse_config

    finetune = _load("finetune")
    args = argparse.Namespace(model="tiny-llama", tokenizer="byte", seq_len=32, batch_size=2, eval_batches=1, seed=1,
                              eval_fraction=0.2, max_samples=0, sweeps=1, steps_per_visit=8, ranges="0-1,2-3")
    configs = {m: parse_config(finetune.run_flags(args, m, "builtin:pydoc", 1e-4, Path("unused")))
               for m in ["bcd", *finetune.LEVERS]}
    assert finetune.method_names("full,levers") == ["full", "bcd", *finetune.LEVERS]
    for method, config in configs.items():
        blocks = config.blocks.sweeps * len(config.blocks.ranges.split(","))
        assert blocks * config.stop.steps_per_visit == 16 and config.run.seed == 1, method
    assert configs["bcd-x4"].blocks.sweeps == 4 and configs["bcd-x4"].stop.steps_per_visit == 2
    assert configs["bcd-lowrank"].blocks.expand == configs["bcd-x4-lowrank"].blocks.expand == "lowrank"
    assert configs["bcd-sgd"].blocks.expand == "sgd" and configs["bcd-x4-keep"].optim.keep_state
    assert configs["bcd-depth-lr"].optim.block_lr == "depth:0.5..1.5"
    assert [configs[f"bcd-expand-lr-{r}"].blocks.expand_lr for r in ("3e-4", "1e-3")] == [3e-4, 1e-3]
    assert configs["bcd-expand-lr-3e-4"].blocks.expand == "lowrank" and configs["bcd"].blocks.expand_lr is None
    assert not configs["bcd"].optim.keep_state and configs["bcd"].blocks.expand == "auto"  # the defaults
    assert resolved_expand(configs["bcd"]) == "lowrank" and configs["bcd-none"].blocks.expand == "none"
    with pytest.raises(SystemExit, match="multiple of 4"):
        finetune.run_flags(argparse.Namespace(**{**vars(args), "steps_per_visit": 6}), "bcd-x4", "builtin:pydoc",
                           1e-4, Path("unused"))


@pytest.mark.slow
def test_finetune_resume_takes_the_rows_measured_with_the_same_flags_and_runs_the_others(tmp_path, monkeypatch):
    """bench.finetune --resume: a run measured before with the same task and flags (the scratch paths aside) is
    taken from <stem>.rows.jsonl, not run again; one with another seed runs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    general = tmp_path / "general.txt"
    general.write_text("".join(f"Paragraph {i}: the fox ran over the hill.\n\n" for i in range(40)))
    out, finetune = tmp_path / "finetune.json", _load("finetune")
    quick = ["--quick", "--methods", "bcd", "--no-speed", "--general", str(general), "--out", str(out)]
    rows_file = out.with_suffix(".rows.jsonl")

    def rows() -> list[dict]:
        return [json.loads(line) for line in rows_file.read_text().splitlines()]

    assert finetune.main(quick) == 0
    first = rows()
    assert len(first) == 1 and "--out" not in first[0]["key"] and "<scratch>/base" in first[0]["key"]
    assert finetune.main([*quick, "--resume"]) == 0
    assert rows() == first and json.loads(out.read_text())["rows"][0]["eval_loss"] == first[0]["eval_loss"]
    assert finetune.main([*quick, "--resume", "--seed", "1", "--in-process"]) == 0  # a row run either way
    assert len(rows()) == 2 and rows()[1]["seed"] == 1
    args = argparse.Namespace(source="tiny-llama")  # BAdam's and LoRA's runs read bcd's flags: keyed apart
    assert len({finetune_runs.run_key(args, "chat", m, ["--lr", "1e-4"], tmp_path) for m in ("bcd", "badam", "lora16")}) == 3
    keys = {flag: finetune_runs.run_key(args, "chat", "bcd", ["--lr", "1e-4", *flag], tmp_path)
            for flag in ((), ("--keep-optimizer-state",))}  # BCD rows: keyed by the expansion their flags resolve to
    assert keys[()].endswith("expand=lowrank") and keys[("--keep-optimizer-state",)].endswith("expand=none")
    assert "expand=" not in finetune_runs.run_key(args, "chat", "lora16", ["--lr", "1e-4"], tmp_path)


METHODS_AT_EQUAL_STEPS = ("full", "bcd", "bcd-none", "bcd-store", "bcd-auto", "bcd-bf16", "bcd-int8", "bcd-nf4",
                          "bcd-nf4-8bit", "badam", "lora8", "lora16", "qlora")


def test_orders_rows_are_real_bcd_runs_of_each_order_and_gain_adds_importance_orders_with_stop_gain(tmp_path):
    """bench.orders's rows: every order of --orders, and with --gain each importance order again with `--stop
    gain`; their flags parse, by the real command line, into BCD-Adam at the UFP asked, pre-inference auto, one epoch
    a visit, and the same cap of epochs for every row (a step budget; an importance order's sweeps of one step)."""
    from pipelines.cli import build_parser
    from pipelines.flags import config_for_command

    orders = _load("orders")
    assert orders.rows_of(orders.parse_args([])) == list(orders.ORDERS)
    args = orders.parse_args(["--orders", "ascending,importance-cached", "--gain", "--sweeps", "6"])
    assert orders.rows_of(args) == ["ascending", "importance-cached", "importance-cached+gain"]
    cases = [("importance-cached+gain", "1/4", 180, "gain"), ("ascending", "1/2", 9, "budget"),
             *((order, "1/3", 180 if order.startswith("importance") else 6, "budget") for order in orders.ORDERS)]
    for row, ufp, sweeps, rule in cases:  # every row capped at 18 visits of 10 steps; an importance sweep may be 1
        flags = orders.bcd_flags(args, tmp_path, row, ufp, visit_steps=10)
        config = config_for_command(build_parser().parse_args(["bcd", *flags]))
        assert (config.blocks.order, config.blocks.ufp, config.blocks.sweeps) == (row.split("+")[0], ufp, sweeps)
        assert (config.stop.rule, config.stop.epochs_per_visit, config.run.mode) == (rule, 1, "bcd")
        assert config.stop.total_steps == 180
        assert config.pre_inference.mode == "auto" and config.optim.lr == args.lr
    full = config_for_command(build_parser().parse_args(["bcd", *orders.full_flags(args, tmp_path)]))
    assert (full.run.mode, full.blocks.sweeps, full.optim.keep_state) == ("full", 12, True)
    levers = orders.parse_args(["--orders", "ascending", "--levers", "none,lowrank,keep"])
    assert orders.rows_of(levers) == ["ascending", "ascending+none", "ascending+lowrank", "ascending+keep"]
    none, lowrank, keep = (config_for_command(build_parser().parse_args(["bcd", *orders.bcd_flags(
        levers, tmp_path, row, "1/3", 10)])) for row in ("ascending+none", "ascending+lowrank", "ascending+keep"))
    assert (lowrank.blocks.expand, lowrank.optim.keep_state, keep.optim.keep_state) == ("lowrank", False, True)
    assert none.blocks.expand == "none" and resolved_expand(keep) == "none"  # auto: kept state runs without it
    assert lowrank.blocks.order == keep.blocks.order == "ascending" and keep.stop.rule == "budget"
    with pytest.raises(SystemExit):
        orders.parse_args(["--orders", "sideways"])
    with pytest.raises(SystemExit):
        orders.parse_args(["--levers", "magic"])
    with pytest.raises(SystemExit):
        orders.parse_args(["--ufps", "1/3,2/3"])
    thirds = orders.parse_args(["--visit-epochs", "1/3", "--full-epochs", "2", "--eval-tokens", "512"])
    full = config_for_command(build_parser().parse_args(["bcd", *orders.full_flags(thirds, tmp_path)]))
    assert full.stop.epochs_per_visit == pytest.approx(1 / 3) and full.blocks.sweeps == 6  # 2 epochs in thirds
    assert full.data.eval_tokens == 512


def test_orders_target_is_full_adam_s_best_once_its_plateau_is_seen():
    """The target: full Adam's best eval loss up to its plateau point plus the window (a later, lower loss does not
    count); a row's time and epochs to it are its first point at or below it, and its ratios are to full Adam's."""
    orders = _load("orders")
    losses = [4.0, 3.0, 2.5, 2.49, 2.495, 2.48, 2.3]  # plateau at index 2 (window 2, 0.5%): 2.49 is not 0.5% below 2.5
    curve = [dict(train_s=10.0 * (i + 1), step=100 * (i + 1), eval_loss=loss) for i, loss in enumerate(losses)]
    full = orders.full_summary(dict(curve=orders.add_epochs(curve, 100), tracked_peak=1), 0.005, 2)
    assert (full["plateau_index"], full["target"], full["best_eval_loss"]) == (2, 2.49, 2.3)
    assert (full["time_to_target"], full["epochs_to_target"]) == (40.0, 4.0)
    bcd = [dict(train_s=5.0 * (i + 1), step=110 * (i + 1), eval_loss=loss) for i, loss in enumerate([3.5, 2.6, 2.49])]
    row = orders.order_summary("ascending", dict(curve=orders.add_epochs(bcd, 100)), full, 0.005, 2)
    assert (row["time_to_target"], row["x_time"]) == (15.0, 15.0 / 40.0)
    assert row["epochs_to_target"] == pytest.approx(3.3) and row["x_epochs"] == pytest.approx(3.3 / 4)
    assert row["best_vs_full_pct"] == pytest.approx(100 * (2.49 / 2.3 - 1))
    assert row["holds"] == dict(x_time=True, x_epochs=True, best_vs_full_pct=False)
    never = orders.order_summary("random", dict(curve=orders.add_epochs(bcd[:2], 100)), full, 0.005, 2)
    assert (never["time_to_target"], never["x_time"], never["holds"]["x_time"]) == (None, None, False)


@pytest.mark.slow
def test_orders_quick_measures_each_order_against_full_adam_s_target(tmp_path):
    """bench.orders --quick --in-process, two of its orders (each run in this process): full Adam and
    each order on tiny-llama; each row's time and epochs to the target are those of its curve's first point at or
    below it, and the UFP table reuses the best row's UFP 1/3 run."""
    out = tmp_path / "orders.json"
    orders = _load("orders")
    assert orders.main(["--quick", "--in-process", "--orders", "ascending,importance", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    full, rows = result["full"], {row["row"]: row for row in result["rows"]}
    assert set(rows) == {"ascending", "importance"} and Path(result["plot"]).stat().st_size > 0
    window = result["settings"]["plateau_window"]
    seen = full["curve"] if full["plateau_index"] is None else full["curve"][: full["plateau_index"] + window + 1]
    assert full["target"] == min(p["eval_loss"] for p in seen)
    assert [p["epochs"] for p in full["curve"]] == [1.0, 2.0]  # one epoch a visit
    for name, row in [("full", full), *rows.items()]:
        curve = row["curve"]
        assert curve and all(a["train_s"] < b["train_s"] and a["epochs"] < b["epochs"] for a, b in zip(curve, curve[1:]))
        reached = [p for p in curve if p["eval_loss"] <= full["target"]]
        expected = (reached[0]["train_s"], reached[0]["epochs"]) if reached else (None, None)
        assert (row["time_to_target"], row["epochs_to_target"]) == expected, name
        assert row["tracked_peak"] > 0
    for name, row in rows.items():
        assert row["best_vs_full_pct"] == pytest.approx(100 * (row["best_eval_loss"] / full["best_eval_loss"] - 1))
        assert row["x_time"] == (None if row["time_to_target"] is None else row["time_to_target"] / full["time_to_target"])
        assert row["curve"][-1]["epochs"] <= 3 * result["settings"]["sweeps"]
    assert rows["importance"]["importance_s"] > 0
    assert rows["ascending"]["curve"][-1]["epochs"] == rows["importance"]["curve"][-1]["epochs"] == 6  # one cap
    table = {r["ufp"]: r for r in result["ufp_table"]}
    assert list(table) == ["1/2", "1/3", "1/4"] and [table[u]["blocks"] for u in table] == [2, 3, 4]
    best = rows[result["best"]]
    assert table["1/3"]["tracked_peak_mib"] == best["tracked_peak"] / 2**20
    assert table["1/2"]["tracked_peak_mib"] > table["1/4"]["tracked_peak_mib"]


def test_peers_fails_loudly_when_a_method_falls_below_its_goal_against_badam(capsys, monkeypatch, tmp_path):
    """Measured ratios injected: preinfer at 0.97x BAdam misses its 1.0x goal (a line naming it, exit 1),
    preinfer-defaults at 0.96x holds its 0.95x; no goal is judged without BAdam beside them."""
    peers = _load("peers")
    measured = dict(steps=30, tracked_peak_mib=85.9, peak_x_badam=1.0, eval_loss=3.4)
    rows = [dict(method="badam", steps_per_s=2.0, steps_per_s_runs=[2.0], x_badam=1.0, **measured),
            dict(method="preinfer", steps_per_s=1.94, steps_per_s_runs=[1.94], x_badam=0.97, **measured),
            dict(method="preinfer-defaults", steps_per_s=1.92, steps_per_s_runs=[1.92], x_badam=0.96, **measured)]
    missed = peers.missed_goals(rows)
    assert len(missed) == 1 and "preinfer ran at 0.970x BAdam's steps/s, below the goal of 1.00x" in missed[0]
    assert peers.missed_goals([{k: v for k, v in row.items() if k != "x_badam"} for row in rows]) == []
    monkeypatch.setattr(peers, "compare", lambda args, scratch: dict(rows=rows, runs={}))
    assert peers.main(["--guard", "--out", str(tmp_path / "peers.json")]) == 1
    assert "goal missed: preinfer ran at 0.970x" in capsys.readouterr().err
    rows[1]["x_badam"] = 1.01
    assert peers.main(["--guard", "--out", str(tmp_path / "peers.json")]) == 0
    guard = peers.parse_args(["--guard"])
    assert (guard.methods, guard.long_steps) == ("badam,preinfer,preinfer-defaults", 0)
