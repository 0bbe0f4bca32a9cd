"""Issue 48 case 9: an expansion rank wider than the model is refused, and a run's memory is checked against the
plan before the model loads: the planner's figure for the largest visit (`preinfer plan`'s bcd live row for the same
flags) against the memory the device has, injected here (never this machine's own); above it, one line naming both
and what to change, exit 2, no model built, nothing in --out; `--skip-memory-check` (`[run] skip_memory_check`)
runs it anyway."""

import json

import pytest

import pipelines.training.memory_check as memory_check
from preinfer.memory.budget import size_text
from tests.helpers.cli_run import failure_line, run_cli
from tests.helpers.composition import ModelBuilds

FLAGS = ["--model", "tiny-llama", "--seq-len", "16", "--batch-size", "2", "--blocks", "2", "--steps-per-visit", "1",
         "--eval-tokens", "64", "--max-samples", "16"]
HOST = "the host has {} available (MemAvailable)"


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    """`preinfer plan`'s bcd live row for FLAGS' run on the CPU."""
    import contextlib
    import io

    from pipelines.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["plan", "--model", "tiny-llama", "--device", "cpu", "--seq-len", "16", "--micro-batch", "2",
                     "--blocks", "2", "--json"]) == 0
    return json.loads(printed.getvalue())["memory"]["bcd_live"]


def available(monkeypatch, size: int) -> None:
    monkeypatch.setattr(memory_check, "available_memory", lambda device: (size, HOST))


def refused(argv: list[str], out, capsys) -> str:
    with ModelBuilds() as builds:
        code, _, err = run_cli([*argv, "--out", str(out)], capsys)
    assert code == 2 and not out.exists() and builds.count == 0, err
    return failure_line(err)


def test_a_run_the_plan_puts_above_the_device_s_memory_is_refused_then_runs_when_told(planned, corpus, tmp_path,
                                                                                     capsys, monkeypatch):
    figure = planned["total"]
    available(monkeypatch, figure - 1)
    out = tmp_path / "run"
    line = refused(["bcd", *FLAGS, "--data", corpus], out, capsys)
    assert (f"the plan puts this run's largest visit, {planned['note']}, at {size_text(figure)} (fp32; preinfer "
            f"plan's bcd live row), but the host has {size_text(figure - 1)} available (MemAvailable): give --recompute, "
            f"a smaller --batch-size, more blocks (--blocks), or --skip-memory-check to run it anyway") in line
    assert run_cli(["bcd", *FLAGS, "--data", corpus, "--out", str(out), "--skip-memory-check", "--total-steps", "1"],
                   capsys)[0] == 0
    code, _, err = run_cli(["bcd", "--out", str(out), "--resume", "--total-steps", "2"], capsys)
    assert code == 0, err  # the saved key holds on resume
    available(monkeypatch, figure)
    assert run_cli(["bcd", *FLAGS, "--data", corpus, "--out", str(tmp_path / "fits"), "--total-steps", "1"],
                   capsys)[0] == 0


def toml(sections: dict[str, dict]) -> str:
    return "".join(f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())
                   for name, keys in sections.items())


@pytest.mark.parametrize("keys, remedies", [
    ({}, "give --recompute, a smaller --batch-size, more blocks (--blocks), or --skip-memory-check to run it anyway"),
    ({"data": {"batch_size": 2}, "blocks": {"blocks": 2}}, "give --recompute, a smaller [data] batch_size, more "
                                                           "blocks ([blocks] blocks), or --skip-memory-check"),
    ({"run": {"recompute": True}, "data": {"batch_size": 1}}, "give more blocks (--blocks), or --skip-memory-check"),
    ({"blocks": {"active": "1-1"}}, "block 1 (layers 1-1)"),  # only the block it trains is priced
], ids=["defaults", "in-the-file", "savers-on", "active"])
def test_a_toml_run_that_cannot_fit_names_what_to_change_by_its_keys(corpus, tmp_path, capsys, monkeypatch, keys,
                                                                     remedies):
    from pipelines.training.runner import check_structure
    from preinfer.config import load_config

    sections = {"model": {"name": "tiny-llama"}, "data": {"seq_len": 16, "eval_tokens": 64},
                "stop": {"steps_per_visit": 1}, "run": {}, "blocks": {}}
    for name, values in keys.items():
        sections[name].update(values)
    path = tmp_path / "c.toml"
    path.write_text(toml(sections))
    available(monkeypatch, 1 << 20)
    line = refused(["bcd", "--config", str(path), "--data", corpus], tmp_path / "run", capsys)
    assert "but the host has 1.00 MiB available (MemAvailable)" in line and remedies in line
    sections["run"]["skip_memory_check"] = True
    path.write_text(toml(sections))
    check_structure(load_config(path))  # told to skip: nothing refused


@pytest.mark.parametrize("keys, checked", [
    ({}, True), ({"optim": {"name": "adam8bit"}}, False), ({"blocks": {"expand": "lowrank"}}, False),
    ({"optim": {"fused_step": True}}, False),
], ids=["priced", "adam8bit", "lowrank", "fused-step"])
def test_a_run_the_planner_does_not_price_is_not_refused_by_its_memory_check(monkeypatch, keys, checked):
    """The planner prices 8-bit moments, the fused step and expansion for dense models only; a mixture-of-experts
    run with them, which bcd trains, is not checked (it was refused with the planner's words), one without is."""
    from pipelines.flags import CONFIG_FLAGS
    from pipelines.training.runner import check_structure
    from preinfer.config import load_config
    from preinfer.errors import UsageError

    config = load_config(overrides={"model": {"name": "tiny-moe"}, "data": {"seq_len": 16}, **keys},
                         flags=CONFIG_FLAGS)
    available(monkeypatch, 1 << 20)
    if checked:
        with pytest.raises(UsageError, match="the plan puts this run's largest visit"):
            check_structure(config)
    else:
        check_structure(config)


def test_the_memory_available_is_the_kernel_s_estimate_on_the_host_and_the_card_s_free_memory(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    2097152 kB\n")
    monkeypatch.setattr(memory_check, "MEMINFO", meminfo)
    assert memory_check.available_memory("cpu") == (2 << 30, HOST)
    monkeypatch.setattr(memory_check.torch.cuda, "is_available", lambda: True)
    asked = []
    monkeypatch.setattr(memory_check.torch.cuda, "mem_get_info", lambda device: asked.append(device) or (5 << 30, 8))
    assert memory_check.available_memory("cuda:1") == (5 << 30, "GPU cuda:1 has {} free")
    assert memory_check.available_memory("cuda")[0] == 5 << 30  # the current device: a rank's own under torchrun
    assert [str(d) for d in asked] == ["cuda:1", "None"]
    assert memory_check.available_memory("mps") is None  # unknown: not checked


@pytest.mark.parametrize("source", ["flag", "toml"])
def test_an_expansion_rank_above_the_widest_narrow_side_is_refused_before_the_model_loads(corpus, tmp_path, capsys,
                                                                                          source):
    """Case 9's first half: `--expand-rank 1000000` on a 64-wide model grew past 4.9 GB and died in the allocator;
    it is judged on the meta skeleton, named as its source gave it. Rank 64 (full rank already) is taken, and a
    run without low-rank expansion does not judge its rank."""
    from pipelines.training.runner import check_structure
    from preinfer.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "tiny-llama"\n[data]\nseq_len = 16\n[stop]\nsteps_per_visit = 1\n[blocks]\n'
                    + ("expand_rank = 1000000\n" if source == "toml" else ""))
    argv = ["bcd", "--config", str(path), "--data", corpus] + (["--expand-rank", "1000000"] if source == "flag" else [])
    line = refused(argv, tmp_path / "run", capsys)
    named = f"{path}: [blocks] expand_rank = 1000000" if source == "toml" else \
        "--expand-rank 1000000 ([blocks] expand_rank)"
    assert line.endswith(f"{named}: expected at most 64, the widest narrow side of the model's linear weights (a "
                         f"rank-64 update is already full rank on every one)")
    for keys in ("expand_rank = 64\n", 'expand_rank = 1000000\nexpand = "sgd"\n'):
        path.write_text('[model]\nname = "tiny-llama"\n[blocks]\n' + keys)
        check_structure(load_config(path))


def test_the_hf_front_end_refuses_an_expansion_rank_wider_than_the_model_naming_the_argument():
    from preinfer.errors import UsageError
    from preinfer.hf import BlockCoordinateDescent
    from preinfer.presets import build_preset

    with pytest.raises(UsageError, match=r"^BlockCoordinateDescent\(expand_rank=65\): expected at most 64, the "
                                         r"widest narrow side"):
        BlockCoordinateDescent(build_preset("tiny-llama", seed=0), steps_per_visit=1, expand="lowrank",
                               expand_rank=65)
