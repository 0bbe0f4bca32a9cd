"""The run configuration: one typed dataclass per section (`sections`), whose enumerated values are the Literals of
`choices`; loaded from TOML and overridden by flags (`files`), validated once before anything is opened
(`Config.validate`, the rules of `rules`), and compared on resume (`resume`)."""

from preinfer.config.choices import (
    ATTENTIONS, DEFAULT_ATTENTION, EXPERT_PARTS, IMPORTANCE_ORDERS, LR_DECAYS, OPEN_ENDED_DECAYS, ORDERS,
    TRACKERS, check_attention, choices, names,
)
from preinfer.config.files import (
    MOVED_RUN_KEYS, ArgumentNaming, SourceNaming, config_from_arguments, config_from_dict, dump_toml,
    load_config, load_resumed,
)
from preinfer.config.resume import PARTITION_ORDER, RESUMABLE_KEYS, check_resume, resume_changes
from preinfer.config.rules import BOUNDS, Naming
from preinfer.config.sections import (
    DEFAULT_EPOCHS_PER_VISIT, DEFAULT_LR, DEFAULT_WEIGHT_DECAY, BlockConfig, Config, DataConfig, ModelConfig,
    OptimConfig, PreInferenceConfig, RunConfig, StopConfig, StoreConfig,
)

report_names = names  # the names of a `run.report_to` value (pipelines.training.trackers)

__all__ = [
    "ATTENTIONS", "BOUNDS", "DEFAULT_ATTENTION", "DEFAULT_EPOCHS_PER_VISIT", "DEFAULT_LR", "DEFAULT_WEIGHT_DECAY",
    "EXPERT_PARTS", "IMPORTANCE_ORDERS", "LR_DECAYS", "MOVED_RUN_KEYS", "OPEN_ENDED_DECAYS", "ORDERS",
    "PARTITION_ORDER", "RESUMABLE_KEYS", "TRACKERS", "ArgumentNaming", "BlockConfig", "Config",
    "DataConfig", "ModelConfig", "Naming", "OptimConfig", "PreInferenceConfig", "RunConfig", "SourceNaming",
    "StopConfig", "StoreConfig", "check_attention", "check_resume", "choices", "config_from_arguments",
    "config_from_dict", "dump_toml",
    "load_config", "load_resumed", "names", "report_names", "resume_changes",
]
