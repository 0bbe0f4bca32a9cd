"""Step and visit sync's wall per step measured over a rate-limited link (issue 46), against the model's prediction.

Needs root (`ip netns`, `tc`). Two ranks, each in a network namespace of its own, joined by a veth pair; each end's
egress is held to --rate-mbit by a tbf qdisc. Each rank is a torchrun agent of its own (`--nnodes 2`, the static
rendezvous at rank 0's veth address) and gloo runs over the veth (`GLOO_SOCKET_IFNAME`), as two nodes would.

First both modes run over the veth unlimited; visit sync's wall per step there is a step's compute (its steps send
no block, and its one sync a visit is cheap on the free link). The rate is then chosen, unless given, so that step
sync's bytes of a step take as long as that compute: step sync's all-reduce costs about the step's compute, as an
8B block's does on 10 Gbps. Under the rate, both modes run again. Per mode: the measured wall per step (the visits'
`wall_s`, their closing syncs included, over the steps), the bytes a rank sent per step (counted at the
collectives), the link's throughput (one TCP transfer between the namespaces, timed at the receiver) and the
model's prediction: compute + bytes per step / throughput (no overlap), as `preinfer plan --bandwidth-gbps` and
`bench.dp_sync` model it. The runs are `bench.dp_sync`'s rows (its model, corpus,
batches and --steps-per-visit). The namespaces are removed at the end, on failure and on SIGTERM too. The machine
is shared and small (2 cores): read the ratios.

    python -m bench.dp_sync_link --steps-per-visit 100
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.common import ROOT, command_line, machine, table, write_json
from bench.lib.dp_sync_runs import arguments, bcd, corpus, measured, records

ADDRESSES = ("10.46.0.1", "10.46.0.2")
PORT = 29546
MODES = ("step", "visit")
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


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m bench.dp_sync_link", __doc__)
    parser.add_argument("--rate-mbit", type=float, help="the link's rate (default: chosen from the free runs)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    data = corpus(work)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the namespaces are removed
    with Link() as link:
        free = measure(args, link, data, work, "free")
        rate = args.rate_mbit or free["step"]["bytes_per_step"] * 8 / free["visit"]["wall_s"] / 1e6
        link.limit(rate)
        mbit = link.throughput()
        started = time.perf_counter()
        limited = measure(args, link, data, work, "limited")
        seconds = time.perf_counter() - started
    rows, compute = [], free["visit"]["wall_s"]  # a step's compute: a step with no block to send, the link free
    for mode in MODES:
        predicted = compute + limited[mode]["bytes_per_step"] * 8 / (mbit * 1e6)
        wall = limited[mode]["wall_s"]
        rows.append(dict(mode=mode, rate_mbit=rate, measured_mbit=mbit, bytes_per_step=limited[mode]["bytes_per_step"],
                         free_wall_s=free[mode]["wall_s"], wall_s=wall, predicted_s=predicted,
                         predicted_x=predicted / wall))
    for row in rows:
        row["wall_x_step"] = row["wall_s"] / rows[0]["wall_s"]
    print(table(rows, ["mode", "rate_mbit", "measured_mbit", "bytes_per_step", "free_wall_s", "wall_s",
                       "predicted_s", "predicted_x", "wall_x_step"]))
    path = write_json("dp_sync_link", dict(command=command_line("dp_sync_link", argv or sys.argv[1:]),
                                           machine=machine(), settings=vars(args), rows=rows,
                                           limited_runs_s=seconds))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
