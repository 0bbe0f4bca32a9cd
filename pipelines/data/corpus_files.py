"""Which files a corpus `spec` names, in reading order: a data file, a directory, a glob pattern, or a Hugging Face
dataset folder.

- A data file: `.txt` or `.jsonl` (plain, `.gz` or `.zst`), `.parquet` or `.arrow`; a file without an extension
  (`LICENSE`, `README`) is plain text. Any other extension is refused in one line.
- A `save_to_disk` folder (`state.json` beside `dataset_info.json`): the `.arrow` files its `state.json` lists, in
  that order; nothing else in it (the `cache-*.arrow` files `datasets.map` leaves are not the dataset's).
- A saved `DatasetDict` (`dataset_dict.json`): the folder of one split, `train` unless another is asked for.
- Any other directory: its data files in path order; when some are named for a split as Hugging Face dataset
  repositories name them (`data/train-00000-of-00001.parquet`, `test.jsonl`, `validation/`: the split's word, or one
  of its synonyms, between non-letters), those of the split asked for (`train` by default) only.
- A glob pattern: the data files it matches (directories it matches: every data file under them), in path order.

The split asked for (`--dataset-split`) must be one the source has, else it is refused in one line naming those it
has; a source without splits (a file, a glob, a directory whose files name none, one `save_to_disk` dataset) is its
`train` split, so asking it for another is refused too.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterable
from pathlib import Path

from preinfer.errors import UsageError

COMPRESSIONS = ("", ".gz", ".zst")
DATA_SUFFIXES = tuple(f"{kind}{compression}" for kind in (".txt", ".jsonl") for compression in COMPRESSIONS) + (
    ".parquet", ".arrow",
)
PLAIN_TEXT = ".txt"  # how a file without an extension is read
SUFFIXES_IN_WORDS = ".txt or .jsonl files (plain, .gz or .zst), .parquet or .arrow files"
DATASET_DICT = "dataset_dict.json"  # what `DatasetDict.save_to_disk` writes beside its splits' directories
DATASET_STATE, DATASET_INFO = "state.json", "dataset_info.json"  # what `Dataset.save_to_disk` writes
DEFAULT_SPLIT = "train"
# The words that name a split in a dataset repository's paths (`datasets.data_files.SPLIT_KEYWORDS`).
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_NON_WORD = re.compile(r"[-._ 0-9]+")


def data_suffix(path: Path) -> str | None:
    """The data suffix `path`'s name ends with (`.jsonl.gz`, `.parquet`, ...), or None."""
    return next((suffix for suffix in DATA_SUFFIXES if path.name.endswith(suffix)), None)


def read_as(path: Path) -> str:
    """The suffix a file of the corpus is read by: its data suffix, or plain text for a file without one."""
    return data_suffix(path) or PLAIN_TEXT


def corpus_files(spec: str, split: str = DEFAULT_SPLIT) -> list[Path]:
    """The data files of a file, directory or glob `spec`, in reading order (not for built-in corpora); `split`
    chooses among the splits of a dataset folder (see the module)."""
    path = Path(spec)
    if path.is_dir():
        return _directory_files(path, split)
    if not path.exists() and not glob.has_magic(spec):
        raise UsageError(f"data file not found: {spec}")
    check_unsplit(spec, split)
    if path.exists():
        return [_single_file(path)]
    matches = [Path(match) for match in glob.glob(spec, recursive=True)]
    if not matches:
        raise UsageError(f"no file matches the pattern '{spec}'")
    expanded = [file for match in matches for file in ([match] if match.is_file() else match.rglob("*"))]
    files = _data_files(expanded)
    if not files:
        raise UsageError(f"the pattern '{spec}' matches no {SUFFIXES_IN_WORDS}")
    return files


def check_unsplit(spec: str, split: str) -> None:
    """Refuse a split other than the default of a source that has no splits."""
    if split != DEFAULT_SPLIT:
        raise UsageError(f"--dataset-split {split}: {spec} has no splits (only a dataset folder or repository has); "
                         f"drop --dataset-split to read all of it")


def _single_file(path: Path) -> Path:
    if not path.is_file():
        raise UsageError(f"{path} is not a regular file (a fifo or a device cannot be read as data)")
    if data_suffix(path) is None and path.suffix:
        raise UsageError(f"{path}: unknown data file extension '{path.suffix}'; expected .txt or .jsonl (plain, .gz "
                         f"or .zst), .parquet, .arrow, a file without an extension (plain text), a directory or a glob "
                         f"pattern of them (or builtin:pydoc)")
    return path


def _directory_files(path: Path, split: str) -> list[Path]:
    if (path / DATASET_DICT).is_file():
        return _directory_files(_dict_split(path, split), split)
    if (path / DATASET_STATE).is_file() and (path / DATASET_INFO).is_file():
        check_unsplit(str(path), split)
        return _saved_files(path)
    files = _data_files(path.rglob("*"))
    if not files:
        raise UsageError(f"directory {path} holds no {SUFFIXES_IN_WORDS}")
    return _split_files(path, files, split)


def _dict_split(path: Path, split: str) -> Path:
    """The directory of split `split` of a saved `DatasetDict`."""
    try:
        splits = json.loads((path / DATASET_DICT).read_text(encoding="utf-8"))["splits"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise UsageError(f"{path / DATASET_DICT}: not a readable DatasetDict description (no 'splits' list)") from None
    if split not in splits or not (path / split).is_dir():
        raise UsageError(f"{path} is a DatasetDict without a '{split}' split (it has {splits}); pass "
                         f"--dataset-split naming one of them")
    return path / split


def _saved_files(path: Path) -> list[Path]:
    """The .arrow files a `save_to_disk` folder's state.json lists, in its order."""
    state = path / DATASET_STATE
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise UsageError(f"{state}: not a readable save_to_disk state (no '_data_files' list of filenames)") from None
    files = []
    for name in names:
        file = path / str(name)
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".arrow"):
            raise UsageError(f"{state}: data file {name!r} is not the name of an .arrow file in {path}")
        if not file.is_file():
            raise UsageError(f"{state} lists {name}, which is not in {path}")
        files.append(file)
    if not files:
        raise UsageError(f"{state} lists no data files")
    return files


def _split_files(base: Path, files: list[Path], split: str) -> list[Path]:
    """The files of `split` where some files are named for a split, else every file."""
    wanted = SPLIT_KEYWORDS.get(split, (split,))
    named = {name: [f for f in files if _names_split(base, f, words)]
             for name, words in {**SPLIT_KEYWORDS, split: wanted}.items()}
    if not any(named.values()):
        check_unsplit(str(base), split)
        return files
    if not named[split]:
        found = sorted(name for name, chosen in named.items() if chosen)
        raise UsageError(f"{base} holds the splits {found}, not '{split}'; pass --dataset-split naming one of them "
                         f"(or --data {base}/PATTERN to read other files)")
    return named[split]


def _names_split(base: Path, file: Path, words: tuple[str, ...]) -> bool:
    """Whether a path component of `file` below `base` holds one of `words` between non-letters."""
    relative = file.relative_to(base)
    names = [*relative.parts[:-1], relative.name.removesuffix(read_as(file))]
    return any(word.lower() in words for name in names for word in _NON_WORD.split(name))


def _data_files(paths: Iterable[Path]) -> list[Path]:
    return sorted({path for path in paths if path.is_file() and data_suffix(path) is not None})


def base_directory(spec: str) -> Path:
    """The directory names of file `spec` are taken relative to: itself (a directory), the pattern's fixed part
    (a glob), or the file's directory."""
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists():
        return path.parent
    fixed = path.parts[: next(i for i, part in enumerate(path.parts) if glob.has_magic(part))]
    return Path(*fixed) if fixed else Path(".")
