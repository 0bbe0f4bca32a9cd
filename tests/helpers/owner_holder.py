"""Another job holding an output: a child process that holds the owner lock of a directory (`storage.owning`), and
the environment a child runs our packages in."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()  # as an owner lock names its holder's host

HOLD = """
import sys
from storage import owning
with owning(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on a child's PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def hold(out: Path) -> subprocess.Popen:
    """A process that holds the owner lock of `out` until its stdin closes (or it is killed)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=child_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder
