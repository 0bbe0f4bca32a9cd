"""A config from a TOML file and flags, validated before it is used, and written back as TOML."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

from preinfer.config.choices import field_hint
from preinfer.config.resume import PARTITION_ORDER, check_resume
from preinfer.config.rules import Naming, is_number
from preinfer.config.sections import DEFAULT_EPOCHS_PER_VISIT, Config
from preinfer.errors import PreinferError, UsageError

# Keys of [run] in configs written before it was split, or renamed since: (section, key) they moved to.
MOVED_RUN_KEYS = {
    "pre_inference": ("pre_inference", "mode"),
    "store_dir": ("pre_inference", "store_dir"),
    "store_format": ("pre_inference", "store_format"),
    "store_dtype": ("pre_inference", "store_dtype"),
    "keep_stores": ("pre_inference", "keep_stores"),
    "dask": ("pre_inference", "dask"),
    "schedule": ("run", "pipeline_schedule"),
    "store": ("store", "path"),
    "trust_store": ("store", "trust"),
}


class SourceNaming(Naming):
    """Names a key as the user gave it: by its flag (`--lr 0 ([optim] lr)`) when an override set it, as
    `FILE: [optim] lr = 0` when the config file did. `flags` maps "section.key" to its flag (none: every key is
    named --key-with-dashes)."""

    def __init__(self, path: str | Path | None, in_file: set[str], in_flags: set[str], flags: Mapping[str, str]):
        self.path, self.in_file, self.in_flags, self.flags = path, in_file, in_flags, flags

    def flag(self, section: str, key: str) -> str | None:
        """The flag that sets a key (None: the key has none)."""
        return self.flags.get(f"{section}.{key}") if self.flags else "--" + key.replace("_", "-")

    def key(self, section: str, key: str) -> str:
        name = f"{section}.{key}"
        by_file = name in self.in_file and name not in self.in_flags
        return (None if by_file else self.flag(section, key)) or super().key(section, key)

    def value(self, section: str, key: str, value: Any) -> str:
        name = f"{section}.{key}"
        if name in self.in_flags:
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            return f"{self.key(section, key)} {shown} ([{section}] {key})"
        written = super().value(section, key, value)
        return f"{self.path}: {written}" if name in self.in_file else written


class ArgumentNaming(Naming):
    """Names a key by the argument that set it, `BlockCoordinateDescent(order='x')`; `arguments` maps
    "section.key" to the argument."""

    def __init__(self, caller: str, arguments: Mapping[str, str]):
        self.caller, self.arguments = caller, arguments

    def key(self, section: str, key: str) -> str:
        return self.arguments.get(f"{section}.{key}") or super().key(section, key)

    def value(self, section: str, key: str, value: Any) -> str:
        argument = self.arguments.get(f"{section}.{key}")
        return f"{self.caller}({argument}={value!r})" if argument else super().value(section, key, value)


def config_from_dict(values: dict, source: str) -> Config:
    """The config a `Config.to_dict` wrote (a checkpoint's), unvalidated; a key this version does not know is
    refused naming `source`."""
    config = Config()
    _apply(config, values, source)
    return config


def config_from_arguments(caller: str, keys: Mapping[str, str], values: Mapping[str, Any]) -> Config:
    """The defaults with `values` (by argument name) at the keys `keys` maps them to ("section.key"), validated:
    a bad value is named by its argument of `caller`. A partition argument given unsets the default's (as a flag
    does), a list or tuple is a comma-list key's list form (or a list key's value), a number a text key's text."""
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise UsageError(f"{caller}() got an unknown argument {unknown[0]!r}: expected {', '.join(keys)}")
    config, given = Config(), set()
    for name, value in values.items():
        section, key = keys[name].split(".")
        target = getattr(config, section)
        setattr(target, key, _argument_value(value, _field(target, key), field_hint(type(target), key)))
        if value is not None:
            given.add(keys[name])
    naming = ArgumentNaming(caller, {key: name for name, key in keys.items()})
    _choose_partition(config, given, naming)
    return config.validate(naming)


def _argument_value(value: Any, item: Any, hint: Any) -> Any:
    """An argument's value in the form its key holds: a list for a list key, "1,0.5" for a comma list given as a
    list, "1/3" text for a number given to a text key such as ufp."""
    if isinstance(value, (list, tuple)):
        return comma_text(list(value)) if item.metadata.get("comma_list") else list(value)
    if hint is str and is_number(value):
        return str(value)
    return value


def _field(section: Any, key: str) -> Any:
    return next(item for item in fields(section) if item.name == key)


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None,
                flags: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the TOML file's values, then `overrides` ({section: {key: value}}, None values skipped; a
    partition key among them unsets the file's others); a visit with no stopping rule gets
    DEFAULT_EPOCHS_PER_VISIT; then validated (`Config.validate`), naming a bad key as the user gave it
    (`SourceNaming`)."""
    config, naming = _loaded(path, overrides, flags)
    return config.validate(naming)


def load_resumed(path: str | Path, overrides: dict[str, dict[str, Any]], flags: Mapping[str, str],
                 where: str) -> Config:
    """A resumed run's config: its own (`path`) with `overrides` on top, refused first where they change a key a
    resume may not (`check_resume`: the changed key is named, not a rule it breaks with the saved config's others),
    then validated as `load_config` does."""
    config, naming = _loaded(path, overrides, flags)
    check_resume(load_config(path), config, where)
    return config.validate(naming)


def _loaded(path: str | Path | None, overrides: dict[str, dict[str, Any]] | None,
            flags: Mapping[str, str] | None) -> tuple[Config, SourceNaming]:
    """`load_config`'s config before it is validated, and how it names its keys."""
    config = Config()
    in_file = _apply(config, _read_toml(Path(path)), source=str(path)) if path is not None else set()
    in_flags = _apply(config, overrides or {}, source="flags")
    naming = SourceNaming(path, in_file, in_flags, flags or {})
    _choose_partition(config, in_file - in_flags, Naming(), where=f"{path}: ")
    _choose_partition(config, in_flags, naming)
    stop = config.stop
    if stop.steps_per_visit is None and stop.epochs_per_visit is None and stop.patience is None:
        stop.epochs_per_visit = DEFAULT_EPOCHS_PER_VISIT
    return config, naming


def _choose_partition(config: Config, given: set[str], naming: Naming, where: str = "") -> None:
    """A partition key given by one source (ufp, blocks or ranges: at most one) unsets the others: an override's
    the file's, the file's the defaults'."""
    chosen = [key for key in PARTITION_ORDER if f"blocks.{key}" in given]
    if len(chosen) > 1:
        given = ", ".join(naming.key("blocks", key) for key in chosen)
        raise UsageError(f"{where}give only one of {', '.join(naming.key('blocks', key) for key in PARTITION_ORDER)} "
                         f"(got {given})")
    for key in PARTITION_ORDER:
        if chosen and key != chosen[0]:
            setattr(config.blocks, key, None)


def _read_toml(path: Path) -> dict:
    if path.exists() and not path.is_file():  # a directory, or a fifo that would block the read
        raise UsageError(f"config file {path} is not a file")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"config file {path} is not valid TOML: {err}") from None
    except OSError as err:
        raise UsageError(f"config file {path}: cannot read it ({err.strerror or err})") from None


def _apply(config: Config, values: dict, source: str) -> set[str]:
    """Set the config's keys from {section: {key: value}} (None values skipped); the "section.key"s set. A
    number is checked and converted here where its field is a float; every value's type, with the rest of
    the rules, in `Config.validate`."""
    applied = set()
    for section, entries in values.items():
        target = getattr(config, section, None)
        if not is_dataclass(target) or not isinstance(entries, dict):
            raise UsageError(f"{source}: unknown config section [{section}]")
        keys = {f.name: f for f in fields(target)}
        for key, value in entries.items():
            if section == "data" and key == "eval_batches":
                raise UsageError(f"{source}: [data] eval_batches is gone: write eval_tokens (tokens evaluated; 0: all)")
            if section == "run" and key in MOVED_RUN_KEYS:
                new_section, new_key = MOVED_RUN_KEYS[key]
                raise UsageError(f"{source}: [run] {key} has moved: write it as {new_key} in [{new_section}]")
            if key not in keys:
                raise UsageError(f"{source}: unknown key '{key}' in [{section}]")
            if value is not None:
                parse = keys[key].metadata.get("parse")
                where = f"{source}: [{section}] {key}"
                parsed = _parse(value, parse, where) if parse else _number(value, field_hint(type(target), key))
                if isinstance(parsed, list) and keys[key].metadata.get("comma_list"):
                    parsed = comma_text(parsed)
                setattr(target, key, parsed)
                applied.add(f"{section}.{key}")
    return applied


def _parse(value: Any, parse: Callable[[Any], Any], where: str) -> Any:
    """A value written as text (a size) in the form the config holds (bytes)."""
    try:
        return parse(value)
    except UsageError as error:
        raise UsageError(f"{where} = {value!r}: {error}") from None


def comma_text(items: list) -> str:
    """A comma-list key written as a list (TOML's `[1, 0.5]`, a Python list) in the comma form the key holds."""
    return ",".join(str(item) for item in items)


def _number(value: Any, hint: Any) -> Any:
    """An integer given for a float field, as a float (TOML writes 1 for 1.0); any other value as it is."""
    return float(value) if hint is float and is_number(value) else value


def dump_toml(config: Config) -> str:
    """The fully resolved config as TOML (None values are left out: they mean 'default')."""
    lines = []
    for section in fields(config):
        lines.append(f"[{section.name}]")
        for key, value in asdict(getattr(config, section.name)).items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise PreinferError(f"cannot write {value!r} as TOML")
