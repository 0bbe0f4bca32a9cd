"""The largest scale this machine holds (issue 37, part 4): a SmolLM2-1.7B-shaped Llama, randomly initialised from
a local config.json, planned and trained on the CPU, each process's peak RSS against the planner's figure for it.

Every step is a process of its own, started under `nice -n 10`; its peak RSS is the kernel's (`os.wait4`'s
ru_maxrss). In order:

1. `write-model`: the config.json, and random float32 weights saved beside it (the trainer loads a model only
   with every tensor present; nothing is committed, the directory is --work);
2. `plan --device cpu`: this machine's physical memory is the budget; full Adam must not fit it;
3. `bcd --ufp 1/3`: every visit, a few steps each, against the planner's worst visit;
4. `bcd --frozen-dtype nf4` and `bcd --frozen-dtype nf4 --optimizer adamw8bit --fused-step` at one layer per
   block, their first visits (--total-steps), against the planner's largest of those visits: each run only when a
   tiny-llama probe with its flags trains, else the probe's refusal is recorded (--quick: the run is a tiny Llama
   itself, its own probe).

    python -m bench.scale                  # SmolLM2-1.7B shape, seq 64, 2 steps per visit (minutes; ~14 GiB RAM)
    python -m bench.scale --quick          # a tiny Llama shape through the same steps (seconds)

The JSON (bench/out/scale.json) holds, per process, its command, exit status, seconds, peak RSS, the planner's
bytes and their ratio. The planner counts tensors only: the Python, torch and transformers runtime a process also
holds (`runtime_rss`: a process that imports them and exits) is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench.lib.common import command_line, machine, write_json
from bench.lib.processes import cli, measured

from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import GIB, Settings
from preinfer.memory.shapes import resolve_shape

# SmolLM2-1.7B's config.json (HuggingFaceTB/SmolLM2-1.7B): 1.71B parameters, tied embedding.
SMOLLM2_1_7B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=8192, rope_theta=130000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    hidden_act="silu", bos_token_id=0, eos_token_id=0,
)
QUICK = {**SMOLLM2_1_7B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4}
# The one-layer-per-block runs, their flags and the planner's settings of them: nf4 frozen layers alone, and with
# 8-bit AdamW and the fused step.
ONE_LAYER_ROWS = {
    "nf4": (["--frozen-dtype", "nf4"], dict(frozen_dtype="nf4")),
    "savers": (["--frozen-dtype", "nf4", "--optimizer", "adamw8bit", "--fused-step"],
               dict(frozen_dtype="nf4", optimizer="adamw8bit", fused_step=True)),
}


def write_model(directory: Path, config: dict) -> None:
    """config.json and random float32 weights of `config` in `directory` (run in a process of its own)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    model.save_pretrained(directory)


def with_ratio(row: dict, planned: int) -> dict:
    """A measured row with the planner's bytes for it and peak RSS over them."""
    return {**row, "planned": planned, "planned_gib": round(planned / GIB, 2),
            "peak_rss_gib": round(row["peak_rss"] / GIB, 2), "rss_over_planned": round(row["peak_rss"] / planned, 3)}


def planned_visits(model: Path, settings: Settings, visits: int) -> int:
    """The planner's largest live visit among the first `visits` blocks of `settings.blocks`."""
    shape = resolve_shape(str(model / "config.json"))
    blocks = partition(shape, settings.blocks)
    return max(bcd_memory(shape, settings, blocks, k, store=False).total for k in range(visits))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama shape instead of SmolLM2-1.7B's")
    parser.add_argument("--work", type=Path, default=None, help="where the model and runs go (default: a temp dir)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="steps per visit")
    parser.add_argument("--saver-visits", type=int, default=2, help="visits of the one-layer-per-block run")
    parser.add_argument("--rows", default="ufp_1_3,nf4,savers",
                        help="the bcd runs: ufp_1_3 (today's flags), nf4, savers (at one layer per block)")
    parser.add_argument("--write-model", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = QUICK if args.quick else SMOLLM2_1_7B
    if args.write_model is not None:
        write_model(args.write_model, config)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="preinfer-scale-"))
    model = work / "model"
    try:
        rows = run_all(model, work, config, args)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    payload = dict(command=command_line("scale", argv if argv is not None else sys.argv[1:]), machine=machine(),
                   shape="quick" if args.quick else "SmolLM2-1.7B", **rows)
    print(json.dumps(payload, indent=1))
    print(f"wrote {write_json('scale-quick' if args.quick else 'scale', payload)}")
    return 0


def run_all(model: Path, work: Path, config: dict, args: argparse.Namespace) -> dict:
    """Every step of the module docstring, as the JSON's rows."""
    seq = str(args.seq_len)
    rows: dict = dict(runtime_rss=measured([sys.executable, "-c", "import torch, transformers, pipelines.cli"])[0])
    rows["write_model"] = measured([sys.executable, "-m", "bench.scale", "--write-model", str(model),
                                    *(["--quick"] if args.quick else [])])[0]
    plan, text = measured(cli("plan", "--model", str(model / "config.json"), "--device", "cpu", "--dtype",
                              "float32", "--seq-len", seq, "--micro-batch", "1", "--ufp", "1/3", "--json"))
    if plan["exit"] != 0:
        raise SystemExit(f"plan failed: {plan['last_line']}")
    result = json.loads(text)
    full, live = result["memory"]["full_adam"], result["memory"]["bcd_live"]
    rows["plan"] = {**plan, "capacity": result["capacity_bytes"], "full_adam": full["total"],
                    "full_adam_fits": full["fits"], "bcd_live_ufp_1_3": live["total"], "bcd_live_fits": live["fits"]}
    train = ["--tokenizer", "byte", "--seq-len", seq, "--batch-size", "1", "--steps-per-visit", str(args.steps),
             "--eval-tokens", seq, "--max-samples", "32", "--pre-inference", "off", "--precision", "fp32",
             "--device", "cpu"]
    if "ufp_1_3" in args.rows:
        rows["bcd_ufp_1_3"] = with_ratio(measured(cli("bcd", "--model", str(model), "--ufp", "1/3",
                                                      "--out", str(work / "ufp3"), *train))[0], live["total"])
    for name, (flags, fields) in ONE_LAYER_ROWS.items():
        if name in args.rows:
            settings = Settings(seq_len=args.seq_len, micro_batch=1, dtype="float32",
                                blocks=config["num_hidden_layers"], host_device=True, **fields)
            rows[f"bcd_{name}_one_layer"] = one_layer_per_block(model, work / name, settings, args, flags, train)
    return rows


def one_layer_per_block(model: Path, out: Path, settings: Settings, args: argparse.Namespace, flags: list[str],
                        train: list[str]) -> dict:
    """A run of the model at one layer per block with `flags` into `out` (its probe's run too), its first
    --saver-visits visits, against the planner's largest of them (`settings`); or, when a tiny-llama probe with
    `flags` does not train, the probe's refusal (--quick: the run's own refusal)."""
    if not args.quick:
        probe, _ = measured(cli("bcd", "--model", "tiny-llama", "--blocks", "4", "--steps-per-visit", "1",
                                "--total-steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "64",
                                "--pre-inference", "off", "--out", str(out / "probe"), *flags))
        shutil.rmtree(out / "probe", ignore_errors=True)
        if probe["exit"] != 0:
            return refused(probe)
    run, _ = measured(cli("bcd", "--model", str(model), "--blocks", str(settings.blocks), "--total-steps",
                          str(args.steps * args.saver_visits), "--out", str(out / "run"), *flags, *train))
    if args.quick and run["exit"] != 0:
        return refused(run)
    return dict(ran=True, flags=" ".join(flags), **with_ratio(run, planned_visits(model, settings, args.saver_visits)))


def refused(probe: dict) -> dict:
    """The row of a one-layer run that bcd refuses: the refused process's row and its last line."""
    return dict(ran=False, probe=probe, note="bcd does not train with these flags yet: " + probe["last_line"])


if __name__ == "__main__":
    sys.exit(main())
