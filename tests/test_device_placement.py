"""Where a run's model lives (`preinfer.device_placement`): with `--stream-frozen` on an accelerator the frozen
layers' streamed tensors stay in host memory as loaded and the device holds what the planner counts; no
whole-model move. The CPU runs the decision with a stand-in device (meta: placed tensors lose their storage, the
ones left in host memory keep theirs); the runs on CUDA itself are marked `cuda` (bench/device_check.sh)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import preinfer
from pipelines.training import placement
from preinfer.config import Config
from preinfer.device_placement import host_tensors, streamed_tensors
from preinfer.frozen_weights import FrozenWeight, QuantizedFrozenLayers
from preinfer.mapped_masters import MappedMasters, MappedSeams, map_file, write_safetensors
from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import resolve_shape
from preinfer.memory.streaming import RESIDENT_STREAMED, streamed_layer_bytes
from preinfer.parallel_dims import parallel_dims
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from preinfer.stream_frozen import LayerStream
from pipelines.cli import main
from pipelines.data.tokenizers import ByteTokenizer
from preinfer.run_dir import RunDir

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def streamed_config(device: str, frozen_dtype: str, masters: str = "host") -> Config:
    config = Config()
    config.model.name, config.model.stream_frozen, config.model.frozen_dtype = "tiny-llama", True, frozen_dtype
    config.model.masters, config.run.device = masters, device
    return config


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@pytest.mark.parametrize("frozen_dtype", ["int8", "auto"])
def test_a_streamed_load_leaves_the_frozen_layers_in_host_memory_and_places_what_the_planner_counts(
        frozen_dtype, monkeypatch):
    """The run's own load path (`WholeModel.load`) onto a stand-in accelerator: no `nn.Module.to` to a device, the
    streamed tensors in host memory with the values they were loaded with, everything else on the device; the
    device's parameters at load, plus a visit's block in its resident dtype and two streamed layers, are the
    planner's device weights of that visit, for each visit."""
    moves = []
    original_to = nn.Module.to
    monkeypatch.setattr(nn.Module, "to", lambda self, *a, **k: moves.append(
        torch._C._nn._parse_to(*a, **k)[0]) or original_to(self, *a, **k))
    model = placement.WholeModel(streamed_config("meta", frozen_dtype), parallel_dims(1, "cpu")).load(0)
    assert not [device for device in moves if device is not None]
    staged, reference = preinfer.stage(model), build_preset("tiny-llama", seed=0).state_dict()
    codes = frozen_dtype != "auto"
    streamed = {id(t) for layer in staged.layers for t in streamed_tensors(layer, codes)}
    for name, param in model.named_parameters():
        if id(param) in streamed:
            assert param.device.type == "cpu" and torch.equal(param, reference[name]), name
        else:
            assert param.is_meta, name
    on_device = [p for p in model.parameters() if p.is_meta]
    shape = resolve_shape("tiny-llama")
    settings = Settings(dtype="float32", frozen_dtype=frozen_dtype, stream_frozen=True, seq_len=16, micro_batch=4)
    spans = partition(shape, 3)
    for k, span in enumerate(spans):
        block = [t for layer in staged.layers[span.start:span.stop] for t in streamed_tensors(layer, codes)]
        frozen = shape.layers - (span.stop - span.start)
        visit = nbytes(on_device) + nbytes(block) + min(RESIDENT_STREAMED, frozen) * \
            streamed_layer_bytes(shape, settings)
        assert visit == bcd_memory(shape, settings, spans, k, store=False).weights, k


@pytest.mark.parametrize("stream", [False, True])
def test_on_the_cpu_the_load_moves_nothing(stream, monkeypatch):
    """The CPU's run path: the model the load builds is the one the run trains, every tensor its own object over its
    own storage (no copy, no new Parameter), streamed or not."""
    built = build_preset("tiny-llama", seed=0)
    tensors = [(id(t), t.data_ptr()) for t in (*built.parameters(), *built.buffers())]
    monkeypatch.setattr(placement, "resolve_model", lambda *args: built)
    config = streamed_config("cpu", "int8")
    config.model.stream_frozen = stream
    model = placement.WholeModel(config, parallel_dims(1, "cpu")).load(0)
    assert model is built and [(id(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())] == tensors


def test_the_decision_holds_everything_in_host_memory_on_the_cpu_and_nothing_without_streaming():
    staged = preinfer.stage(build_preset("tiny-llama", seed=0))
    every = {id(t) for t in (*staged.model.parameters(), *staged.model.buffers())}
    assert host_tensors(staged, streamed_config("cpu", "int8")) == every
    resident = streamed_config("cuda", "int8")
    resident.model.stream_frozen = False
    assert host_tensors(staged, resident) == set()
    linears = {id(m.weight) for layer in staged.layers for m in layer.modules() if isinstance(m, nn.Linear)}
    assert host_tensors(staged, streamed_config("cuda", "nf4")) == linears


def test_each_layer_s_codes_leave_the_device_before_the_next_layer_s_are_built():
    """The frozen-dtype hook built after the stream (as the trainer builds them), copies on: at most one layer's
    codes are ever held by the device while the model is first quantized."""
    staged = preinfer.stage(build_preset("tiny-llama", seed=0))
    stream = LayerStream(staged.layers, "cpu", codes=True, copies=True)
    stream.stream(range(staged.num_layers))
    seen = []

    def placed(index: int) -> None:
        live = [i for i in range(staged.num_layers) for code in _codes(staged.layers[i])
                if code.untyped_storage().nbytes() > 0]
        seen.append((index, sorted(set(live))))
        stream.evict(index)

    QuantizedFrozenLayers(staged, "int8", "cpu", placed)
    assert seen == [(i, [i]) for i in range(staged.num_layers)]
    assert all(code.untyped_storage().nbytes() == 0 for layer in staged.layers for code in _codes(layer))


def _codes(layer: nn.Module) -> list[torch.Tensor]:
    return [code for m in layer.modules() if isinstance(getattr(m, "weight", None), FrozenWeight)
            for code in m.weight.codes]


def test_masters_on_disk_map_the_host_tensors_from_the_block_s_new_file_and_leave_the_device_s_in_place(tmp_path):
    """An accelerator's visit end (the decision of a CUDA config, on CPU tensors): the block's linear weights, which
    live in host memory between visits, are mapped from its new file; its norms, which the device holds
    throughout, keep their storage, equal to the file."""
    model = build_preset("tiny-llama", seed=0)
    write_safetensors(tmp_path / "model.safetensors", model.state_dict().items())
    staged = preinfer.stage(model)
    block = make_partition(staged, num_blocks=3).blocks[1]
    seams = MappedSeams(staged, streamed_config("cuda", "int8", "disk"), MappedMasters(tmp_path / "masters", {}, ()))
    params = {name: p for name, p in model.named_parameters() if any(p is q for q in block.params)}
    before = {name: p.data_ptr() for name, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    seams.block = block
    seams.deactivate()
    (written,) = seams.masters.paths()
    mapped = map_file(written)
    assert mapped.keys() == params.keys()
    for name, param in params.items():
        assert torch.equal(param, mapped[name])
        linear = name.endswith("proj.weight")
        assert (param.data_ptr() != before[name]) == linear, name  # a new storage: the new file's mapping


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("frozen_dtype", ["nf4", "auto"])
def test_on_cuda_a_streamed_disk_run_exports_the_streamed_host_run_and_loads_only_the_placed_tensors(
        frozen_dtype, tmp_path, corpus):
    """The GPU's own path: at load the device holds exactly the tensors the decision places (the allocator's
    rounding aside), and `--masters disk` (masters read from their files onto the device, written back at the
    visit's end) exports what `--masters host` exports, bit for bit."""
    model_dir = tmp_path / "model"
    build_preset("tiny-llama", seed=3).to(torch.bfloat16).save_pretrained(model_dir)
    ByteTokenizer().save(model_dir)
    config = streamed_config("cuda", frozen_dtype, "disk")
    config.model.name, config.run.out = str(model_dir), str(tmp_path / "probe")
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model = placement.WholeModel(config, parallel_dims(1, "cpu")).load(0)
    placed = [t for t in (*model.parameters(), *model.buffers()) if t.is_cuda]
    assert torch.cuda.max_memory_allocated() - start <= sum(-(-nbytes([t]) // 512) * 512 for t in placed)
    assert all(not t.is_cuda for layer in preinfer.stage(model).layers
               for t in streamed_tensors(layer, frozen_dtype != "auto"))
    del model, placed
    for masters in ("host", "disk"):
        assert main(["bcd", "--model", str(model_dir), "--data", corpus, "--seq-len", "16", "--batch-size", "2",
                     "--blocks", "3", "--steps-per-visit", "2", "--lr", "1e-3", "--eval-tokens", "32",
                     "--max-samples", "8", "--pre-inference", "off", "--expand", "none", "--frozen-dtype",
                     frozen_dtype, "--optimizer", "adamw8bit", "--fused-step", "--checkpoint-every", "1",
                     "--stream-frozen", "--device", "cuda", "--masters", masters,
                     "--out", str(tmp_path / masters)]) == 0
    host, disk = (load_file(str(tmp_path / m / "export" / "model.safetensors")) for m in ("host", "disk"))
    assert host.keys() == disk.keys() and all(torch.equal(host[k], disk[k]) for k in host)
    assert load_file(str(RunDir(tmp_path / "disk").checkpoint_weights)) == {}  # every block in its file
