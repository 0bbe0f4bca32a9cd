"""Masters on disk at the largest scale this machine holds (issue 45, part 4): the Llama-3-8B shape, randomly
initialised from a local config.json into bf16 safetensors shards (about 16 GB), trained a few steps of BCD with
`--masters disk --frozen-dtype nf4 --optimizer adamw8bit --fused-step` at one layer per block (the ends apart),
exported, and the export checked tensor by tensor: each trained block's tensors equal the run's own file of it, every
other tensor the untouched original's.

Each step is a process of its own under `nice -n 10` (`bench.lib.processes.measured`): its peak RSS from
`os.wait4`, and its peak anonymous and file-backed RSS sampled from /proc (the mapped masters' pages are
file-backed: page cache the kernel takes back under pressure, never written). The planner's figure is its largest
visit among those run (`preinfer.memory`, on the CPU); with its frozen weights' masters in host memory, and
without them (in the files' pages instead: what --masters disk moves out of the process's own memory).

    python -m bench.masters_disk --work /work/scratch/masters   # 8B shape (tens of minutes; ~16 GB of disk)
    python -m bench.masters_disk --quick --work /tmp/q            # a tiny Llama shape through the same steps

The model and run directories under --work are deleted at the end (--keep keeps them); the JSON goes to
bench/out/masters_disk.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench.lib.common import command_line, machine, write_json
from bench.lib.processes import cli, measured

from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import GIB, Settings
from preinfer.memory.shapes import resolve_shape

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B): 8.03B parameters, untied head, bf16.
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
)
QUICK = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 1}
SAVERS = ["--frozen-dtype", "nf4", "--optimizer", "adamw8bit", "--fused-step", "--expand", "none"]
SHARD_BYTES = 2 * 2**30


def write_model(directory: Path, config: dict) -> None:
    """config.json and random bf16 weights (normal, std 0.02; norms at 1) in shards, one shard in memory at a time."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from preinfer.mapped_masters import write_safetensors

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.bfloat16)
    shapes = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    generator = torch.Generator().manual_seed(0)
    shards, weight_map, size = [[]], {}, 0
    for name, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = [(name, torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else
                    torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator))
                   for name, shape in shard]
        write_safetensors(directory / file, tensors)
        weight_map.update({name: file for name, _ in shard})
    total = sum(2 * int(torch.Size(shape).numel()) for _, shape in shapes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def check_export(model: Path, run: Path) -> dict:
    """Every exported tensor against the run's file of its block (trained) or the original's (untouched)."""
    import torch

    from preinfer.mapped_masters import map_file

    def mapped(directory: Path) -> dict:
        tensors = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors.update(map_file(file))
        return tensors

    original, exported, trained = mapped(model), mapped(run / "export"), mapped(run / "masters")
    assert exported.keys() == original.keys(), sorted(exported.keys() ^ original.keys())[:3]
    same_as_trained = all(torch.equal(exported[name], tensor) for name, tensor in trained.items())
    untouched = [name for name in original if name not in trained]
    same_as_original = all(torch.equal(exported[name], original[name]) for name in untouched)
    changed = sum(not torch.equal(trained[name], original[name]) for name in trained)
    return dict(trained_tensors=len(trained), trained_equal_run_files=same_as_trained,
                untouched_tensors=len(untouched), untouched_equal_original=same_as_original,
                trained_tensors_changed=changed)


def planned(model: Path, settings: Settings, visits: int) -> dict:
    """The planner's largest visit among the first `visits` blocks: its total with the frozen masters in host
    memory, and without them."""
    shape = resolve_shape(str(model / "config.json"))
    blocks = partition(shape, settings.blocks, settings.separate_ends)
    worst = max((bcd_memory(shape, settings, blocks, k, store=False) for k in range(visits)), key=lambda m: m.total)
    return dict(planned_host_masters=worst.total, planned_disk_masters=worst.total - worst.host,
                planned_gib=round(worst.total / GIB, 2), planned_disk_gib=round((worst.total - worst.host) / GIB, 2))


def step_seconds(run: Path) -> list[float]:
    """Each step's seconds, from its record (`visit_s` is the visit's wall up to the step's end)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "step"]
    before = [0.0 if r["visit_step"] == 1 else p["visit_s"] for p, r in zip([None, *steps], steps)]
    return [round(r["visit_s"] - b, 1) for r, b in zip(steps, before)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.masters_disk", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama shape instead of Llama-3-8B's")
    parser.add_argument("--work", type=Path, required=True, help="where the model and the run go (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the model and the run under --work")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="steps per visit")
    parser.add_argument("--visits", type=int, default=2, help="visits run (the embedding's block first)")
    parser.add_argument("--write-model", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = QUICK if args.quick else LLAMA3_8B
    if args.write_model is not None:
        write_model(args.write_model, config)
        return 0
    model, run = args.work / "model", args.work / "run"
    if args.work.exists() and any(args.work.iterdir()):
        raise SystemExit(f"--work {args.work} is not empty")
    try:
        rows = run_all(model, run, config, args)
    finally:
        if not args.keep:
            for directory in (model, run):
                shutil.rmtree(directory, ignore_errors=True)
    payload = dict(command=command_line("masters_disk", argv if argv is not None else sys.argv[1:]),
                   machine=machine(), shape="quick" if args.quick else "Llama-3-8B", **rows)
    print(json.dumps(payload, indent=1))
    print(f"wrote {write_json('masters_disk-quick' if args.quick else 'masters_disk', payload)}")
    return 0


def run_all(model: Path, run: Path, config: dict, args: argparse.Namespace) -> dict:
    """Write the model, train it, check the export: the JSON's rows."""
    rows: dict = dict(runtime_rss=measured([sys.executable, "-c", "import torch, transformers, pipelines.cli"])[0])
    rows["write_model"] = measured([sys.executable, "-m", "bench.masters_disk", "--work", str(model.parent),
                                    "--write-model", str(model), *(["--quick"] if args.quick else [])])[0]
    layers = config["num_hidden_layers"]
    train = ["bcd", "--model", str(model), "--masters", "disk", *SAVERS, "--blocks", str(layers),
             "--separate-ends", "--tokenizer", "byte", "--seq-len", str(args.seq_len), "--batch-size", "1",
             "--steps-per-visit", str(args.steps), "--total-steps", str(args.steps * args.visits), "--eval-tokens",
             str(args.seq_len), "--max-samples", "16", "--pre-inference", "off", "--out", str(run)]
    trained, _ = measured(cli(*train), sample_s=0.5)
    settings = Settings(seq_len=args.seq_len, micro_batch=1, dtype="bf16-mixed", blocks=layers, separate_ends=True,
                        frozen_dtype="nf4", optimizer="adamw8bit", fused_step=True, expand="none", host_device=True)
    plan = planned(model, settings, args.visits)
    rows["bcd"] = {**trained, **plan, "step_seconds": step_seconds(run) if trained["exit"] == 0 else [],
                   "peak_rss_gib": round(trained["peak_rss"] / GIB, 2),
                   "peak_rss_anon_gib": round(trained["peak_rss_anon"] / GIB, 2),
                   "peak_rss_file_gib": round(trained["peak_rss_file"] / GIB, 2),
                   "anon_over_planned_disk": round(trained["peak_rss_anon"] / plan["planned_disk_masters"], 3),
                   "rss_over_planned_disk": round(trained["peak_rss"] / plan["planned_disk_masters"], 3)}
    if trained["exit"] == 0:
        rows["export_check"] = check_export(model, run)
        rows["run_files_gib"] = round(sum(p.stat().st_size for p in (run / "masters").iterdir()) / GIB, 2)
        rows["checkpoint_gib"] = round(sum(p.stat().st_size for p in (run / "checkpoint").iterdir()) / GIB, 3)
    return rows


if __name__ == "__main__":
    sys.exit(main())
