"""Test-wide settings: one intra-op thread (the tests' tensors are tiny; on a busy 2-core machine more threads
only contend), inherited by the subprocesses the tests start."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
