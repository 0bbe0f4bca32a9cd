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
from transformers.utils import logging as framework_logging

from preinfer.errors import UsageError, first_line
from preinfer.presets import PRESETS, preset_config
from preinfer.families import stage

# Where the framework's messages while loading a model (transformers' load report, its warnings) go: logged at
# INFO, which the command line shows with --verbose only.
FRAMEWORK_LOG = logging.getLogger("preinfer.framework")


def local_config(spec: str) -> PreTrainedConfig:
    """The config of a preset or of a local model directory, without building the model."""
    if spec in PRESETS:
        return preset_config(spec)
    try:
        with framework_messages():
            return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read a model config from '{spec}': {first_line(err)}") from None


def check_stageable(config: PreTrainedConfig, spec: str) -> None:
    """Refuse, before any weight is read, a config whose causal LM preinfer cannot stage (it is built on the
    meta device: no memory)."""
    try:
        with framework_messages(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise UsageError(f"--model '{spec}': no causal LM for model type '{config.model_type}': "
                         f"{first_line(err)}") from None
    stage(model)


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
