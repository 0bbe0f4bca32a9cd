"""Which tokenizer a job takes, and whether its ids fit the model.

`--tokenizer auto` (the default) follows the model: a `save_pretrained` directory's own tokenizer (a directory
without tokenizer files is refused: pass `--tokenizer` explicitly), the run's tokenizer for a run directory, the
byte tokenizer for a preset. `byte` or a tokenizer directory is taken as given. Whatever is taken must not hold
more ids than the model's embedding has rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pipelines.data.sample_blocks import chat_fit_line
from pipelines.data.token_store import TokenStoreDataset
from pipelines.data.tokenizers import Tokenizer, load_tokenizer
from pipelines.models import is_run_dir
from preinfer.config import load_config
from preinfer.errors import UsageError
from preinfer.model_config import local_config
from preinfer.presets import PRESETS
from preinfer.run_dir import RunDir

AUTO = "auto"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class TokenizerChoice:
    """The tokenizer a job takes and why."""

    tokenizer: Tokenizer
    reason: str

    def lines(self) -> list[str]:
        """What a run says first about its tokenizer and how it renders chat and instruction data."""
        tokenizer = self.tokenizer
        lines = [f"tokenizer: {tokenizer.name} ({self.reason}; {tokenizer.vocab_size} ids"
                 f"{', BOS ' + str(list(tokenizer.bos_ids)) if tokenizer.bos_ids else ', no BOS'})"]
        if tokenizer.chat_template_file is not None:
            lines.append(f"chat and instruction data: rendered by the chat template of {tokenizer.chat_template_file}")
        elif tokenizer.chat_template_name is not None:
            lines.append(f"chat and instruction data: rendered by the tokenizer's own chat template "
                         f"'{tokenizer.chat_template_name}'")
        elif tokenizer.chat_template is not None:
            lines.append("chat and instruction data: rendered by the tokenizer's own chat template")
        else:
            lines.append("chat and instruction data: the tokenizer has no chat template, so instruction records use "
                         "the fixed '### Instruction' prompt format")
        return lines


def choose_tokenizer(spec: str, model: str, chat_template_file: str | None = None,
                     chat_template_name: str | None = None) -> TokenizerChoice:
    """The tokenizer `--tokenizer spec` names for `--model model` (see the module), its chat template replaced by
    `chat_template_file` or chosen among its named ones by `chat_template_name`; a run directory's template choice
    unless one of them is given."""
    template = (chat_template_file, chat_template_name)
    if spec != AUTO:
        return TokenizerChoice(load_tokenizer(spec, *template), "given by --tokenizer")
    if is_run_dir(model):
        run = load_config(RunDir(model).config).model
        inner = choose_tokenizer(run.tokenizer, run.name,
                                 *(template if any(template) else (run.chat_template, run.chat_template_name)))
        return TokenizerChoice(inner.tokenizer, f"the tokenizer of the run in {model}")
    if model in PRESETS:
        return TokenizerChoice(load_tokenizer("byte", *template), f"--model {model} is a preset")
    if not Path(model).is_dir():
        raise UsageError(f"--model '{model}' is neither a preset ({', '.join(PRESETS)}) nor an existing local "
                         f"directory")
    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"--model {model} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass "
                         f"--tokenizer DIR naming the model's tokenizer (or --tokenizer byte)")
    return TokenizerChoice(load_tokenizer(model, *template), "the model directory's own")


def model_vocab_size(model: str) -> int:
    """The rows of the embedding of `model` (a preset, a model directory or a run directory), from its config."""
    if is_run_dir(model):
        return model_vocab_size(load_config(RunDir(model).config).model.name)
    return int(local_config(model).get_text_config().vocab_size)


def check_fits(tokenizer: Tokenizer, model: str) -> None:
    """Refuse a tokenizer with more ids than the model's embedding has rows."""
    rows = model_vocab_size(model)
    if tokenizer.vocab_size > rows:
        raise UsageError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, but the embedding of --model "
                         f"{model} has {rows} rows; pass the model's own tokenizer (--tokenizer auto or DIR)")


def model_tokenizer(spec: str, model: str, chat_template_file: str | None = None,
                    chat_template_name: str | None = None) -> TokenizerChoice:
    """`choose_tokenizer`, refused when its ids do not fit the model (`check_fits`)."""
    choice = choose_tokenizer(spec, model, chat_template_file, chat_template_name)
    check_fits(choice.tokenizer, model)
    return choice


def data_lines(choice: TokenizerChoice, splits: Mapping[str, TokenStoreDataset]) -> list[str]:
    """The run's first lines about its data: the tokenizer taken and why, how chat data is rendered, and what the
    seq_len rule did to each split's conversations."""
    lines = choice.lines()
    for name, split in splits.items():
        info = split.info
        if info.kind == "chat":
            described = info.splits[name]
            dropped = described.documents - described.samples - described.skipped
            fit = chat_fit_line(described.documents, described.truncated, dropped, info.seq_len, described.skipped)
            lines.append(f"{name}: {fit}")
    return lines


def announce(choice: TokenizerChoice, splits: Mapping[str, TokenStoreDataset], quiet: bool) -> None:
    """Write `data_lines` (unless `quiet`)."""
    if not quiet:
        for line in data_lines(choice, splits):
            tqdm.write(line)
