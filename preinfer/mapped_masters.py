"""Masters on disk (`--masters disk`): every weight of the model memory-mapped from safetensors files, never read
whole into host memory.

`map_file` maps a safetensors file copy-on-write (opened read-only, `mmap.ACCESS_COPY`): reading a tensor brings
its pages into the page cache, which the kernel takes back under pressure; writing one gives the written pages to
this process alone; the file itself is never written. Before a block has trained, its tensors are the model
directory's own; at the end of each visit (`MappedSeams.deactivate`) the trained block is written whole into a
new file of the run's own, `masters/block-NNNN-HEX.safetensors` in the run directory (`write_atomically`: a
hidden temporary, fsynced, renamed into place), and its tensors are mapped again from that file, so that the pages
it trained in are given back. Which file holds each block is part of the checkpoint (`MappedMasters.record`, in
state.json, whose digest the checkpoint records), so a kill during or after a visit's write and before the next
checkpoint resumes from the files that checkpoint names: the newer file is unreferenced, and the next checkpoint
deletes it (`MappedMasters.prune`). A checkpoint holds only the tensors that differ from their files (the active
block mid-visit; `MappedMasters.clean` names the others).

`write_safetensors` writes the safetensors format tensor by tensor (its header first, from shapes and dtypes),
so that writing a block, or an export's shard, holds at most one tensor's bytes beside the model.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import struct
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from preinfer.atomic_write import write_atomically
from preinfer.checkpoint import Checkpoint, load_checkpoint, refuse_non_finite, save_checkpoint
from preinfer.config import Config
from preinfer.device_placement import host_tensors
from preinfer.errors import CheckpointError
from preinfer.seams import SingleProcess
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.staged import StagedModel
from preinfer.visit_optimizer import VisitOptimizer

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
BLOCK_FILE = re.compile(r"block-\d{4}-[0-9a-f]{8}\.safetensors")  # what `MappedMasters.end` writes
LEFTOVER = re.compile(r"\.block-\d{4}-[0-9a-f]{8}\.safetensors\.tmp-\d+-[0-9a-f]{8}")  # a write killed midway


def map_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, memory-mapped copy-on-write (see the module's docstring)."""
    try:
        with open(path, "rb") as stream:
            mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY)
        size = struct.unpack("<Q", mapped[:8])[0]
        header = json.loads(mapped[8:8 + size])
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointError(f"cannot map the weights in {path}: {err}") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + size + start) if count else \
            torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(entry["shape"])
    return tensors


def write_safetensors(file: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Write `tensors` (name, tensor) as a safetensors file, tensor by tensor; returns the file's sha256."""
    tensors = [(name, tensor.detach()) for name, tensor in tensors]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset,
                                                                                                   offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(file, "wb") as stream:
        for chunk in (struct.pack("<Q", len(text)), text):
            stream.write(chunk)
            digest.update(chunk)
        for _, tensor in tensors:
            _write_tensor(stream, digest, tensor)
    return digest.hexdigest()


def _write_tensor(stream, digest, tensor: torch.Tensor) -> None:
    """Append `tensor`'s bytes (a contiguous copy of it in host memory at most) to `stream` and to `digest`."""
    data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    stream.write(data)
    digest.update(data)


def recorded_paths(directory: Path, record: Mapping[str, dict]) -> list[Path]:
    """The run's files a checkpoint's `record` names (block index -> {file, sha256}), in block order."""
    return [directory / entry["file"] for _, entry in sorted(record.items(), key=lambda item: int(item[0]))]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


class MappedMasters:
    """The run's own master files in `directory` (`files`: block index -> {file, sha256}, the newest of each
    trained block) and the names of the model's tensors that equal their files (`clean`)."""

    def __init__(self, directory: Path, files: Mapping[str, dict], clean: Iterable[str]):
        self.directory, self.files, self.clean = directory, dict(files), set(clean)

    @classmethod
    def recorded(cls, run: RunDir, record: Mapping[str, dict]) -> MappedMasters:
        """The files a checkpoint's `record` names (nothing yet clean), each checked against its sha256."""
        for entry in record.values():
            path = run.masters / entry["file"]
            if not path.is_file() or file_sha256(path) != entry["sha256"]:
                raise CheckpointError(f"{path} is missing or does not match the sha256 its checkpoint recorded; "
                                      f"the run cannot resume from this checkpoint")
        return cls(run.masters, record, ())

    def paths(self) -> list[Path]:
        """The run's files, in the order they override the model's."""
        return recorded_paths(self.directory, self.files)

    def record(self) -> dict[str, dict]:
        """What a checkpoint records: which file holds each trained block."""
        return dict(self.files)

    def end(self, block: int, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Write block `block`'s tensors (refused when one is not finite) into a new file of the run's, crash-safe;
        returns them mapped from it."""
        refuse_non_finite(dict(named), f"at the end of block {block}'s visit")
        self.directory.mkdir(exist_ok=True)
        path = self.directory / f"block-{block:04d}-{uuid.uuid4().hex[:8]}.safetensors"
        digest: list[str] = []
        write_atomically(path, lambda file: digest.append(write_safetensors(file, named.items())))
        self.files[str(block)] = {"file": path.name, "sha256": digest[0]}
        self.clean |= set(named)
        return map_file(path)

    def prune(self) -> None:
        """Delete the files this run wrote that no recorded block names (a newer block written before a kill, or
        replaced by a later visit's) and the temporaries of a write killed midway."""
        if not self.directory.is_dir():
            return
        kept = {entry["file"] for entry in self.files.values()}
        for path in self.directory.iterdir():
            if (BLOCK_FILE.fullmatch(path.name) and path.name not in kept) or LEFTOVER.fullmatch(path.name):
                path.unlink(missing_ok=True)


class MappedSeams(SingleProcess):
    """One process whose masters are on disk: a visit's block is marked changed when it opens, written and mapped
    again when it ends; checkpoints hold what the files do not, and record the files. On an accelerator the block
    trains on the device (its masters read from their files there as the visit opens); at its end the tensors
    that live in host memory between visits (`preinfer.device_placement.host_tensors`) are mapped from the new
    file, and those the device holds throughout (the ends, the layers' norms) stay there, equal to it."""

    def __init__(self, staged: StagedModel, config: Config, masters: MappedMasters):
        super().__init__(staged, config)
        self.masters = masters
        self.block: Block | None = None
        self.host = host_tensors(staged, config)

    def activate(self, block: Block, boundary: int, visit: VisitOptimizer) -> None:
        self.block = block
        self.masters.clean -= set(self._named(block))

    def deactivate(self) -> None:
        """Write the trained block and map its parameters from its new file (its trained pages given back)."""
        named = self._named(self.block)
        mapped = self.masters.end(self.block.index, named)
        for name, param in named.items():
            if id(param) in self.host:
                param.data = mapped[name]
        self.block = None

    def save(self, run_dir: RunDir, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
             masters: list[torch.Tensor]) -> None:
        save_checkpoint(run_dir.checkpoint, model, optimizers, trainer_state, masters,
                        mapped=self.masters.clean, files=self.masters.record())
        self.masters.prune()

    def load(self, run_dir: RunDir, model: nn.Module) -> Checkpoint:
        checkpoint = load_checkpoint(run_dir.checkpoint, model, self.masters.clean)
        self.masters.clean -= checkpoint.weights  # the active block of a mid-visit checkpoint
        return checkpoint

    def _named(self, block: Block) -> dict[str, nn.Parameter]:
        """The block's parameters by their first state-dict names."""
        ids = {id(param) for param in block.params}
        return {name: param for name, param in self.staged.model.named_parameters() if id(param) in ids}
