"""A model's config without its weights: read from a preset or a local model directory's config.json
(`local_config`), refused before any weight is read when preinfer cannot stage its causal LM (`check_stageable`),
with the framework's messages kept off stderr (`framework_messages`).

These live in `preinfer`, not with model loading in `pipelines.models`, because the planner needs them:
`preinfer.memory.shapes.resolve_shape` sizes a model from its config, and `preinfer` never imports `pipelines`.
Nothing here reads a weight file; loading weights (whole, a suffix, a pipeline stage) is `pipelines.models`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging as framework_logging

from preinfer.errors import UsageError
from preinfer.presets import PRESETS, preset_config
from preinfer.families import stage
from preinfer.staged import StagedModel

# Where the framework's messages while loading a model (transformers' load report, its warnings) go: logged at
# INFO, which the command line shows with --verbose only.
FRAMEWORK_LOG = logging.getLogger("preinfer.framework")


# The refusals transformers raises for a config it cannot read or build a model of: a file that is no JSON, a field of
# the wrong type (its strict dataclasses), a value its model cannot be built with, an unknown model type.
CONFIG_REFUSALS = (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError, StrictDataclassError)
# The sizes of a config that the planner and a model's build read: each an integer in [1, MAX_SIZE] where set.
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_key_value_heads",
               "head_dim", "intermediate_size")
MAX_SIZE = 2**31 - 1


@contextmanager
def config_refusals(what: str) -> Iterator[None]:
    """transformers' refusal of a config inside the block as one UsageError: `what` (`cannot read a model config
    from 'PATH'`), then transformers' words on one line."""
    try:
        yield
    except CONFIG_REFUSALS as err:
        raise UsageError(f"{what}: {one_line(err)}") from None


def one_line(err: BaseException) -> str:
    """A library's multi-line message joined into one line."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def local_config(spec: str) -> PreTrainedConfig:
    """The config of a preset or of a local model directory, without building the model."""
    if spec in PRESETS:
        return preset_config(spec)
    with config_refusals(f"cannot read a model config from '{spec}'"), framework_messages():
        return AutoConfig.from_pretrained(spec, local_files_only=True)


def check_sizes(config: PreTrainedConfig, source: str) -> None:
    """Refuse, in one line naming `source` and the field, a size in SIZE_FIELDS that is not an integer in
    [1, MAX_SIZE] (a list, as some families give per layer, is not checked here)."""
    for key in SIZE_FIELDS:
        value = getattr(config, key, None)
        if value is None or isinstance(value, list):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise UsageError(f"{source}: {key} = {value!r}: expected an integer in [1, 2^31)")


def check_stageable(config: PreTrainedConfig, spec: str) -> None:
    """Refuse, before any weight is read, a config whose sizes are out of range or whose causal LM preinfer cannot
    stage (it is built on the meta device: no memory)."""
    skeleton(config, spec)


def skeleton(config: PreTrainedConfig, spec: str) -> StagedModel:
    """The causal LM of `config` built on the meta device (no memory, no weight read or initialised) and staged:
    its structure, for the rules a run judges before it loads the model; refusals as `check_stageable`."""
    check_sizes(config, spec if spec.endswith(".json") or spec in PRESETS else f"{spec}/config.json")
    with config_refusals(f"--model '{spec}': no causal LM for model type '{config.model_type}'"), \
            framework_messages(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return stage(model)


@contextmanager
def framework_messages() -> Iterator[None]:
    """Send what transformers logs (its load report, warnings) to FRAMEWORK_LOG instead of stderr, and hide its
    progress bars; both as they were afterwards."""
    handler = _Forward()
    root = framework_logging.get_logger()
    bars = framework_logging.is_progress_bar_enabled()
    framework_logging.disable_default_handler()
    framework_logging.disable_progress_bar()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        framework_logging.enable_default_handler()
        if bars:
            framework_logging.enable_progress_bar()


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        FRAMEWORK_LOG.info("%s", record.getMessage())
