"""`--grad-compression`'s bucket sums (`preinfer.grad_compression`) on two gloo processes started once: bf16 equals
torch's own `bf16_compress_hook` (times the world size: the buckets hold shares of the mean, not gradients to
average); PowerSGD sums gradients of rank at most R exactly, its error feedback loses nothing over the steps (the
compressed sums plus the replicas' errors are the exact sums), the bytes each rank sends are the factors', and
its warm-up steps are plain fp32 sums."""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from preinfer.config.sync_rules import parse_grad_compression
from preinfer.errors import UsageError

SHAPES = [(6, 40), (40,), (30, 8)]  # two matrices PowerSGD compresses at rank 2, and a vector it does not


class Bucket:
    """What torch's DDP communication hooks ask of a gradient bucket: its flat buffer."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def gradients(rank: int, step: int, low_rank: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    if not low_rank:
        return [torch.randn(shape, generator=generator) for shape in SHAPES]
    return [torch.randn(shape[0], 1, generator=generator) @ torch.randn(1, shape[1], generator=generator)
            if len(shape) == 2 else torch.randn(shape, generator=generator) for shape in SHAPES]


def summed(tensors: list[torch.Tensor], compression: str, state=()):
    """`tensors` as gradients, summed by one bucket of `compression`; (sums, reducer)."""
    from preinfer.grad_buckets import BucketedAllReduce
    from preinfer.wire import Wire

    params = [torch.zeros(t.shape) for t in tensors]
    for param, grad in zip(params, tensors):
        param.grad = grad.clone()
    reducer = BucketedAllReduce(params, wire=Wire(), compression=compression, state=state)
    reducer.finish()
    return [p.grad for p in params], reducer


def _rank(rank: int, init_file: str, results: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = {}
    grads = gradients(rank, 0, low_rank=False)
    ours, reducer = summed(grads, "bf16")
    flat = torch.cat([g.reshape(-1) for g in reversed(grads)])  # a bucket holds its tensors in reverse order
    torch_sum = bf16_compress_hook(None, Bucket(flat)).wait() * 2
    out["bf16_equal"] = torch.equal(torch.cat([g.reshape(-1) for g in reversed(ours)]), torch_sum)
    out["bf16_bytes"] = reducer.sum.wire.step_bytes
    exact = [sum(gradients(r, 0, low_rank=True)[i] for r in (0, 1)) for i in range(len(SHAPES))]
    ours, reducer = summed(gradients(rank, 0, low_rank=True), "powersgd:2")
    out["low_rank_error"] = max(((a - b).norm() / b.norm()).item() for a, b in zip(ours, exact))
    out["powersgd_bytes"] = reducer.sum.wire.step_bytes
    total = [torch.zeros(shape) for shape in SHAPES]
    state = []
    for step in range(3):  # full-rank gradients, then zeros: the errors carry what the factors left out
        grads = gradients(rank, step, low_rank=False) if step < 2 else [torch.zeros(s) for s in SHAPES]
        ours, reducer = summed(grads, "powersgd:2", state)
        state = reducer.state()
        total = [t + o for t, o in zip(total, ours)]
    errors = {reducer.buckets[b][i]: e.clone() for (b, i), e in reducer.sum.error.items()}  # by tensor index
    for error in errors.values():
        dist.all_reduce(error)
    exact = [sum(gradients(r, s, low_rank=False)[i] for r in (0, 1) for s in (0, 1)) for i in range(len(SHAPES))]
    out["feedback_error"] = max(((total[i] + e - exact[i]).norm() / exact[i].norm()).item()
                                for i, e in errors.items())
    out["vector_error"] = ((total[1] - exact[1]).norm() / exact[1].norm()).item()  # summed whole
    plain, _ = summed(gradients(rank, 0, low_rank=False), "none")
    warm, reducer = summed(gradients(rank, 0, low_rank=False), "powersgd:2:1")  # one plain step, then PowerSGD
    out["warmup_equal"] = all(torch.equal(a, b) for a, b in zip(warm, plain))
    out["warmup_bytes"] = reducer.sum.wire.step_bytes
    _, reducer = summed(gradients(rank, 1, low_rank=False), "powersgd:2:1", reducer.state())
    out["after_warmup_bytes"] = reducer.sum.wire.step_bytes
    Path(results, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("compression")
    mp.spawn(_rank, args=(str(root / "init"), str(root)), nprocs=2, join=True)
    return [json.loads((root / f"{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.distributed
def test_bf16_is_torchs_bf16_compress_hook_at_half_the_bytes(two_ranks):
    elements = sum(torch.Size(shape).numel() for shape in SHAPES)
    assert all(rank["bf16_equal"] and rank["bf16_bytes"] == 2 * elements for rank in two_ranks)


@pytest.mark.distributed
def test_powersgd_sums_low_rank_gradients_exactly_and_sends_the_factors(two_ranks):
    """A 2-rank all-reduce sends each rank's tensor once: P (n x 2) and Q (m x 2) of each matrix, the vector whole."""
    factors = sum((shape[0] + shape[1]) * 2 for shape in SHAPES if len(shape) == 2)
    assert all(rank["low_rank_error"] <= 1e-5 and rank["powersgd_bytes"] == 4 * (factors + 40) for rank in two_ranks)


@pytest.mark.distributed
def test_powersgd_error_feedback_loses_nothing_over_the_steps(two_ranks):
    assert all(rank["feedback_error"] <= 1e-5 and rank["vector_error"] <= 1e-6 for rank in two_ranks)


@pytest.mark.distributed
def test_powersgd_warm_up_sums_its_steps_plainly_then_compresses(two_ranks):
    """`powersgd:2:1`: the first step's sum is fp32 all-reduce's bit for bit, the second (the state carried) sends
    the factors."""
    elements = sum(torch.Size(shape).numel() for shape in SHAPES)
    factors = sum((shape[0] + shape[1]) * 2 for shape in SHAPES if len(shape) == 2)
    assert all(rank["warmup_equal"] and rank["warmup_bytes"] == 4 * elements
               and rank["after_warmup_bytes"] == 4 * (factors + 40) for rank in two_ranks)


def test_compression_parses_rank_and_warm_up():
    assert [parse_grad_compression(t) for t in ("none", "bf16", "powersgd:4", "powersgd:8:20")] == \
        [None, None, (4, 0), (8, 20)]


@pytest.mark.parametrize("text", ["powersgd", "powersgd:0", "bf8", "powersgd:x", "powersgd:4:", "powersgd:4:1:2"])
def test_a_bad_compression_is_refused(text):
    with pytest.raises(UsageError, match=f"^--grad-compression {text}: expected none, bf16 or powersgd:R"):
        parse_grad_compression(text)
