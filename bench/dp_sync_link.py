"""Step and visit sync's wall per step measured over a rate-limited link (issue 46), against the model's prediction.

Needs root (`ip netns`, `tc`). Two ranks, each in a network namespace of its own, joined by a veth pair; each end's
egress is held to --rate-mbit by a tbf qdisc. Each rank is a torchrun agent of its own (`--nnodes 2`, the static
rendezvous at rank 0's veth address) and gloo runs over the veth (`GLOO_SOCKET_IFNAME`), as two nodes would.

The benchmark runs in rounds (--rounds). In each, both modes first run over the veth unlimited: that mode's wall
per step there is its compute (the step, and whatever the collectives cost over a free link: gloo's copies,
PowerSGD's factorisations). The rate is then chosen in the first round, unless given, so that step sync's bytes of
a step take as long as visit sync's free step: step sync's all-reduce costs about the step's compute, as an 8B
block's does on 10 Gbps. Under the rate, both modes run again. Per mode and round: the measured wall per step (the
visits' `wall_s`, their closing syncs included, over the steps), the bytes a rank sent per step (counted at the
collectives), the link's throughput (one TCP transfer between the namespaces, timed at the receiver) and the
model's prediction: the mode's free wall + bytes per step / throughput (no overlap), as `preinfer plan
--bandwidth-gbps` and `bench.dp_sync` model it. A round's free and limited runs are minutes apart at most, so the
machine's load moves less between them; the table holds the medians over the rounds. The runs are
`bench.dp_sync`'s rows (its model, corpus, batches and --steps-per-visit). The namespaces are removed at the end,
on failure and on SIGTERM too. The machine is shared and small (2 cores): read the ratios.

    python -m bench.dp_sync_link --steps-per-visit 100
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.common import ROOT, command_line, machine, table, write_json
from bench.lib.dp_sync_runs import arguments, bcd, corpus, measured, records

ADDRESSES = ("10.46.0.1", "10.46.0.2")
PORT = 29546
MODES = ("step", "visit")
COLUMNS = ["mode", "rate_mbit", "measured_mbit", "bytes_per_step", "free_ms", "wall_ms", "predicted_ms",
           "predicted_x", "wall_x_step"]
RECEIVER = """import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
connection, _ = server.accept()
first, size = None, 0
while chunk := connection.recv(1 << 16):
    first = first or time.perf_counter()
    size += len(chunk)
print(size * 8 / (time.perf_counter() - first) / 1e6)
"""


class Link:
    """Two network namespaces joined by a veth pair (`with Link() as link:`; removed on exit)."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.spaces = (f"dp46-{tag}-0", f"dp46-{tag}-1")
        self.devices = (f"v46a{tag}", f"v46b{tag}")

    def __enter__(self) -> Link:
        try:
            for space in self.spaces:
                sh("ip", "netns", "add", space)
            sh("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            for space, device, address in zip(self.spaces, self.devices, ADDRESSES):
                sh("ip", "link", "set", device, "netns", space)
                sh("ip", "-n", space, "addr", "add", f"{address}/24", "dev", device)
                sh("ip", "-n", space, "link", "set", device, "up")
                sh("ip", "-n", space, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for space in self.spaces:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", space], capture_output=True)

    def unlimit(self) -> None:
        """Each end's egress free again (its default qdisc)."""
        for space, device in zip(self.spaces, self.devices):
            subprocess.run(["ip", "netns", "exec", space, "tc", "qdisc", "del", "dev", device, "root"],
                           capture_output=True)

    def limit(self, rate_mbit: float) -> None:
        """Each end's egress at `rate_mbit` (a tbf qdisc)."""
        for space, device in zip(self.spaces, self.devices):
            sh("ip", "netns", "exec", space, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate",
               f"{rate_mbit:.3f}mbit", "burst", "32kb", "latency", "400ms")

    def spawn(self, rank: int, command: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.spaces[rank], *command], cwd=ROOT, **kwargs)

    def throughput(self, nbytes: int = 4 << 20) -> float:
        """Mbit/s of one TCP transfer of `nbytes` from rank 0's namespace to rank 1's."""
        receiver = self.spawn(1, [sys.executable, "-c", RECEIVER, ADDRESSES[1], str(PORT + 1)],
                              stdout=subprocess.PIPE, text=True)
        receiver.stdout.readline()
        sender = ("import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
                  f"s.sendall(bytes({nbytes})); s.close()")
        self.spawn(0, [sys.executable, "-c", sender, ADDRESSES[1], str(PORT + 1)]).wait()
        return float(receiver.communicate()[0])


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


def run_pair(link: Link, flags: list[str]) -> None:
    """One `preinfer` run on the link's two ranks, each a torchrun agent in its namespace."""
    processes = []
    for rank, device in enumerate(link.devices):
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                 "--nproc-per-node", "1", "--master-addr", ADDRESSES[0], "--master-port", str(PORT),
                 "-m", "pipelines.cli", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": device}
        processes.append(link.spawn(rank, agent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True))
    failed = [p.communicate()[1][-2000:] for p in processes if p.wait() != 0]
    if failed:
        raise RuntimeError(f"a rank failed: {failed[0]}")


def wall_per_step(out: Path) -> float:
    """The visits' wall (their closing syncs included) over the run's steps."""
    steps, visits = records(out)
    return sum(v.wall_s for v in visits) / len(steps)


def measure(args: argparse.Namespace, link: Link, data: str, work: Path, label: str) -> dict:
    """Both modes' runs on the link as it is now: wall per step and bytes per step."""
    rows = {}
    for mode in MODES:
        out = work / f"link-{label}-{mode}"
        run_pair(link, bcd(args, 2, mode, data, out))
        rows[mode] = dict(wall_s=wall_per_step(out), bytes_per_step=measured(out)["bytes_per_step"])
    return rows


def one_round(args: argparse.Namespace, link: Link, data: str, work: Path, rate: float | None) -> list[dict]:
    """Both modes over the free link, then under `rate` (None: chosen from these free runs): a row per mode."""
    link.unlimit()
    free = measure(args, link, data, work, "free")
    rate = rate or free["step"]["bytes_per_step"] * 8 / free["visit"]["wall_s"] / 1e6
    link.limit(rate)
    mbit = link.throughput()
    limited = measure(args, link, data, work, "limited")
    rows = []
    for mode in MODES:
        sent, wall = limited[mode]["bytes_per_step"], limited[mode]["wall_s"]
        predicted = free[mode]["wall_s"] + sent * 8 / (mbit * 1e6)
        rows.append(dict(mode=mode, rate_mbit=rate, measured_mbit=mbit, bytes_per_step=sent,
                         free_ms=free[mode]["wall_s"] * 1e3, wall_ms=wall * 1e3, predicted_ms=predicted * 1e3,
                         predicted_x=predicted / wall, wall_x_step=wall / limited["step"]["wall_s"]))
    return rows


def medians(rounds: list[list[dict]]) -> list[dict]:
    """Each mode's row: the medians over the rounds (the per-round ratios' medians, not ratios of medians)."""
    rows = []
    for index, first in enumerate(rounds[0]):
        column = [r[index] for r in rounds]
        rows.append({"mode": first["mode"], "bytes_per_step": first["bytes_per_step"],
                     **{key: statistics.median(r[key] for r in column)
                        for key in first if key not in ("mode", "bytes_per_step")}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m bench.dp_sync_link", __doc__)
    parser.add_argument("--rate-mbit", type=float, help="the link's rate (default: chosen from the first free runs)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of free then limited runs [3]")
    args = parser.parse_args(argv)
    work = Path(args.work)
    data = corpus(work, args.corpus)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the namespaces are removed
    started, rounds, rate = time.perf_counter(), [], args.rate_mbit
    with Link() as link:
        for _ in range(args.rounds):
            rounds.append(one_round(args, link, data, work, rate))
            rate = rounds[0][0]["rate_mbit"]
            print(table(rounds[-1], COLUMNS), flush=True)
    rows = medians(rounds)
    print(f"medians over {len(rounds)} rounds:\n{table(rows, COLUMNS)}")
    path = write_json("dp_sync_link", dict(command=command_line("dp_sync_link", argv or sys.argv[1:]),
                                           machine=machine(), settings=vars(args), rows=rows, rounds=rounds,
                                           seconds=time.perf_counter() - started))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
