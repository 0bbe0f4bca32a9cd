"""What a run was trained on: its config.toml names every input by an absolute path (`recorded_config`), and
inputs.json holds a fingerprint of each (`input_fingerprints`): the data (the corpus's content, as the token store
fingerprints it; or a cache's stores), the tokenizer and the chat template. `--resume` resolves the recorded paths
as recorded, whatever the working directory, and `check_inputs` refuses it in one line when an input changed.

The corpus is read once for its fingerprint at a run's start (`run_corpus`): the same digest goes into inputs.json
(or is checked against it) and into the token store's fingerprint (`pipelines.data.run_data.load_datasets`)."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from preinfer.atomic_write import write_atomically
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.presets import PRESETS
from preinfer.run_dir import RunDir
from pipelines.cache.directory import cache_splits
from pipelines.data.corpus import CorpusDigest, corpus_fingerprint
from pipelines.data.token_store.layout import read_info
from pipelines.data.token_store.resolve import is_token_store
from pipelines.data.tokenizer_choice import model_tokenizer
from storage import open_store

# Config keys that name a file or directory, each with the values that do not (keywords, presets); a value with a
# scheme (builtin:, s3://) names none either.
PATH_KEYS: dict[str, tuple[str, ...]] = {
    "model.name": tuple(PRESETS), "model.tokenizer": ("auto", "byte"), "model.chat_template": (),
    "data.path": (), "data.token_store": (), "pre_inference.store_dir": (), "store.path": (),
}
INPUTS_VERSION = 1


def absolute_path(key: str, value: str | None) -> str | None:
    """`value` of the config key `key` as an absolute path where it names a local one, else as it is."""
    if value is None or value in PATH_KEYS[key] or value.startswith("builtin:") or "://" in value:
        return value
    return str(Path(value).absolute())


def recorded_config(config: Config) -> Config:
    """A copy of `config` whose path keys (`PATH_KEYS`) are absolute: what the run directory records."""
    recorded = copy.deepcopy(config)
    for key in PATH_KEYS:
        section, name = key.split(".")
        part = getattr(recorded, section)
        setattr(part, name, absolute_path(key, getattr(part, name)))
    return recorded


def absolute_flags(args: argparse.Namespace) -> None:
    """Make the path flags given (`--data`, `--tokenizer`, ...) absolute, as a recorded config's are, so that a
    resumed run compares them with its own paths."""
    for key in PATH_KEYS:
        dest = key.replace(".", "__")
        if getattr(args, dest, None) is not None:
            setattr(args, dest, absolute_path(key, getattr(args, dest)))


def _digest(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def run_corpus(config: Config) -> CorpusDigest | None:
    """The fingerprint of the corpus a run reads (its dataset split's files), None when it reads a token store or
    a cache's stores."""
    d = config.data
    if config.store.path is not None or is_token_store(d.path):
        return None
    return corpus_fingerprint(d.path, split=d.dataset_split)


def input_fingerprints(config: Config, corpus: CorpusDigest | None = None) -> dict[str, Any]:
    """The fingerprints of a run's inputs: its tokenizer (the chat template included), the chat template alone, and
    its data (the corpus's content, also a token store's, and the dataset split read) or, training from a cache,
    each store's fingerprint. `corpus`: the run's `run_corpus`, where it has it already."""
    m = config.model
    tokenizer = model_tokenizer(m.tokenizer, m.name, m.chat_template, m.chat_template_name).tokenizer
    found: dict[str, Any] = {"version": INPUTS_VERSION, "tokenizer": tokenizer.fingerprint(),
                             "chat_template": _digest(tokenizer.chat_template)}
    if config.store.path is not None:
        found["store"] = {split: open_store(path, check_files=False).fingerprint.digest
                          for split, path in cache_splits(config.store.path).items()}
    elif is_token_store(config.data.path):
        found["data"] = read_info(Path(config.data.path)).fingerprint["parts"]["corpus_digest"]
    else:
        found["data"] = (corpus or run_corpus(config))[0]
    if config.store.path is None:
        found["dataset_split"] = config.data.dataset_split
    return found


def write_inputs(run: RunDir, inputs: dict[str, Any]) -> None:
    """Record the fingerprints of the run's inputs (`input_fingerprints`) in its directory."""
    write_atomically(run.inputs, json.dumps(inputs, indent=1))


def check_inputs(run: RunDir, config: Config, corpus: CorpusDigest | None = None) -> None:
    """Refuse to resume the run in `run` when an input differs from the one it was trained on, in one line naming
    it; a run that recorded no inputs (written before they were recorded) resumes unchecked. `corpus` as
    `input_fingerprints`."""
    try:
        recorded = json.loads(run.inputs.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict):
        raise UsageError(f"--resume: {run.inputs} is not a readable JSON record of what the run was trained on; "
                         f"start a new run in another --out")
    current = input_fingerprints(config, corpus)
    m = config.model
    template = m.chat_template or f"the tokenizer's own{f' {m.chat_template_name!r}' if m.chat_template_name else ''}"
    names = {"data": f"the data {config.data.path}",
             "dataset_split": f"the dataset split ({config.data.dataset_split})",
             "store": f"the stores of --store {config.store.path}",
             "chat_template": f"the chat template ({template})",
             "tokenizer": f"the tokenizer ({m.tokenizer}, model {m.name})"}
    changed = [name for key, name in names.items() if key in recorded and recorded[key] != current.get(key)]
    if changed and changed[-1] == names["tokenizer"] and names["chat_template"] in changed:
        changed.pop()  # the tokenizer's fingerprint holds its template: that change is the template's
    if changed:
        raise UsageError(f"--resume: {' and '.join(changed)} changed since the run in {run.path} started; a resumed "
                         f"run trains on what it started with: restore it, or start a new run in another --out")
