"""The contract on outputs (issue 28, cases 1-3; DESIGN invariant 12): a command refuses a directory that is not
its own kind of output in one line and deletes nothing; one job at a time holds an output, a second one exits 1
naming the holder (`--overwrite` too); a lock left by a killed job is taken over, with a line saying so. Each case
runs the command as a user does (in this process where it can) and checks the exit code, the one line, and what
remains on disk."""

import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from moto.server import ThreadedMotoServer

from tests.helpers.cli_run import run_cli
from tests.helpers.owner_holder import HOST, child_env, hold
from storage import location

INJECT = Path(__file__).parents[1] / "helpers" / "inject.py"
TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-tokens", "128", "--lr", "1e-3", "--max-samples", "16"]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (what must remain as it was)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def users_files(root: Path, *names: str) -> dict[str, bytes]:
    """Files of a user's under `root`; their snapshot."""
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"the user's {name}")
    return snapshot(root)


def one_line(err: str) -> str:
    """The error line of a refused command, asserting there is exactly one and no traceback."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def cache_args(corpus: str, out: str, *extra: str) -> list[str]:
    return ["cache", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--boundary", "1",
            "--samples-per-shard", "16", "--quiet", "--out", out, *extra]


# ---- nothing a user owns is deleted (cases 1 and 2) ----


@pytest.mark.parametrize("command", [
    ["bcd", *TINY],
    ["train", "--store", "no-such-cache", "--steps-per-visit", "2"],
    ["cache", "--model", "tiny-llama", "--boundary", "1"],
    ["tokenize"],
], ids=["bcd", "train", "cache", "tokenize"])
def test_a_directory_of_the_users_is_refused_and_kept(command, tmp_path, capsys):
    out = tmp_path / "mine"
    before = users_files(out, "checkpoint/mine.txt", "loss.png")
    code, _, err = run_cli([*command, "--out", str(out)], capsys)
    assert code == 2
    line = one_line(err)
    assert str(out) in line and "nothing was deleted" in line
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["checkpoint", "loss.png"]


def test_a_store_dir_of_the_users_is_refused_and_kept(tmp_path, corpus, capsys):
    stores = tmp_path / "stores"
    before = users_files(stores, "probe-rank0/mine.txt", "notes.txt")
    code, _, err = run_cli(["bcd", *TINY, "--data", corpus, "--blocks", "2", "--pre-inference", "auto", "--store-dir",
                            str(stores), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "nothing was deleted" in one_line(err)
    assert snapshot(stores) == before


def test_the_probe_refuses_a_probe_directory_it_did_not_write_and_deletes_nothing(tmp_path, corpus):
    """The pre-inference disk probe's own check: a `probe-rankN` holding a user's file stays whole, and the
    message that says nothing was deleted is true."""
    from pipelines.cache import CacheOptions
    from pipelines.data.tokenizers import load_tokenizer
    from pipelines.pre_inference import probe
    from pipelines.pre_inference.sweep_plan import Throughputs
    import preinfer
    from pipelines.models import resolve_model
    from preinfer.errors import UsageError

    stores = tmp_path / "stores"
    (stores / "probe-rank0").mkdir(parents=True)
    (stores / "probe-rank0" / "mine.txt").write_text("x")
    with pytest.raises(UsageError, match="nothing was deleted"):
        probe.probe_store(preinfer.stage(resolve_model("tiny-llama")), [], load_tokenizer("byte"),
                          stores / "probe-rank0", CacheOptions(mode="overwrite"), 4, 4, 1024,
                          Throughputs(layer_seconds=1.0, write_bps=1.0, read_bps=1.0))
    assert (stores / "probe-rank0" / "mine.txt").read_text() == "x"


def test_a_failed_start_can_be_run_again(tmp_path, corpus, capsys):
    """A run directory whose start failed (an empty config.toml, no checkpoint) is started again, not refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("")
    code, _, err = run_cli(["bcd", *TINY, "--data", corpus, "--out", str(out)], capsys)
    assert code == 0, err
    assert (out / "summary.json").is_file() and (out / "config.toml").stat().st_size > 0


# ---- one writer per output (case 3) ----


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("command", [
    ["bcd", *TINY],
    ["cache", "--model", "tiny-llama", "--boundary", "1", "--quiet"],
    ["cache", "--model", "tiny-llama", "--boundary", "1", "--quiet", "--overwrite"],
    ["tokenize", "--quiet"], ["tokenize", "--quiet", "--overwrite"],
], ids=["bcd", "cache", "cache-overwrite", "tokenize", "tokenize-overwrite"])
def test_a_second_job_on_a_held_output_exits_1_naming_the_holder(command, tmp_path, corpus, capsys):
    out = tmp_path / "out"
    holder = hold(out)
    try:
        (out / "theirs.bin").write_text("being written")
        code, _, err = run_cli([*command, "--data", corpus, "--out", str(out)], capsys)
    finally:
        holder.stdin.close()
        holder.wait()
    assert code == 1, err
    assert f"pid {holder.pid} on host {HOST}" in one_line(err)
    assert (out / "theirs.bin").read_text() == "being written"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lock_left_by_a_killed_job_is_taken_over_with_a_line(tmp_path, corpus, capsys):
    out = tmp_path / "tokens"
    holder = hold(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / ".owner.lock").is_file()  # what the killed job left
    code, _, err = run_cli(["tokenize", "--data", corpus, "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    assert f"took over the owner lock of a job that is no longer running (pid {holder.pid} on host {HOST})" in err
    assert not (out / ".owner.lock").exists() and (out / "token-store.json").is_file()


def start_paused_cache(corpus: str, out: str, gate: Path) -> subprocess.Popen:
    """`preinfer cache` that stops once it holds its output and has made its stores (before writing a shard)
    until `gate/go` exists; returns when it is there."""
    gate.mkdir()
    job = subprocess.Popen([sys.executable, str(INJECT), f"pipelines.cache.build:_run_jobs@before=pause:{gate}", "--",
                            *cache_args(corpus, out)], env=child_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (gate / "held").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.05)
    return job


def two_jobs_on_one_output(corpus: str, out: str, gate: Path, overwrite: bool, capsys) -> None:
    """Exactly one of two caching jobs on `out` runs (the second, with or without --overwrite, exits 1 naming
    the first), and the store the first writes verifies."""
    first = start_paused_cache(corpus, out, gate)
    code, _, err = run_cli(cache_args(corpus, out, "--seed", "1", *(["--overwrite"] if overwrite else [])), capsys)
    assert code == 1 and f"pid {first.pid} on host {HOST}" in one_line(err)
    (gate / "go").write_text("")
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-2000:]
    code, out_text, err = run_cli(["verify", out], capsys)
    assert code == 0 and "OK" in out_text, out_text + err
    code, _, err = run_cli(cache_args(corpus, out), capsys)  # the first job's store, complete: nothing to redo
    assert code == 0, err


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("overwrite", [False, True], ids=["resume", "overwrite"])
def test_two_caching_jobs_on_one_local_output(overwrite, tmp_path, corpus, capsys):
    two_jobs_on_one_output(corpus, str(tmp_path / "cache"), tmp_path / "gate", overwrite, capsys)
    assert not (tmp_path / "cache" / ".owner.lock").exists()


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; its endpoint and fake credentials in the environment."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}.items():
            env.setenv(name, value)
        env.delenv("AWS_ENDPOINT_URL", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        fs = location("s3://contract/x").fs
        fs.mkdir("contract")
        yield fs
    server.stop()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("overwrite", [False, True], ids=["resume", "overwrite"])
def test_two_caching_jobs_on_one_s3_output(overwrite, s3, tmp_path, corpus, capsys):
    out = f"s3://contract/two-{int(overwrite)}"
    two_jobs_on_one_output(corpus, out, tmp_path / "gate", overwrite, capsys)
    assert not s3.exists(f"contract/two-{int(overwrite)}/.owner.json")  # released


@pytest.mark.slow
def test_an_expired_s3_lease_is_taken_over_with_a_line(s3, corpus, capsys):
    s3.pipe_file("contract/stale/.owner.json", json.dumps(
        {"pid": 4242, "host": "gone", "token": "old", "expires": time.time() - 1}).encode())
    code, _, err = run_cli(cache_args(corpus, "s3://contract/stale"), capsys)
    assert code == 0, err
    assert "took over the owner lease of a job that is no longer running (pid 4242 on host gone)" in err
    s3.pipe_file("contract/live/.owner.json", json.dumps(
        {"pid": 4343, "host": "there", "token": "new", "expires": time.time() + 60}).encode())
    code, _, err = run_cli(cache_args(corpus, "s3://contract/live"), capsys)
    assert code == 1 and "pid 4343 on host there" in one_line(err)
