"""The rules a config obeys before anything is opened: each key's type and choices (from its field's type), each
number's range (`BOUNDS`), and the rules between keys (`rule_problems`). `check` refuses the first broken one in
one line that names the key as its source does (a flag, `[section] key` in a file, an argument)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from itertools import chain
from typing import Any, Literal, get_origin

from preinfer.config.choices import (
    DEFAULT_LR, IMPORTANCE_ORDERS, LOW_BIT_OPTIMIZERS, OPEN_ENDED_DECAYS, choices_of, field_hint, is_names,
    is_optional, names, parse_experts,
)
from preinfer.block_lr import FLOAT32_MAX, GRAMMAR, parse_block_lr
from preinfer.errors import UsageError
from preinfer.partition import parse_ufp
from preinfer.config.memory_rules import (
    frozen_dtype_problems, fused_step_problems, loss_problems, masters_problems, stream_frozen_problems,
)
from preinfer.config.sync_rules import dp_sync_problems
from preinfer.torchao_extra import torchao_installed


class Naming:
    """How a source names a key and its value; by default as a config file writes them: `[run] mode = 'x'`."""

    def key(self, section: str, key: str) -> str:
        return f"[{section}] {key}"

    def value(self, section: str, key: str, value: Any) -> str:
        return f"{self.key(section, key)} = {value!r}"


@dataclass(frozen=True)
class Bound:
    """A number's range: `rule` as the message writes it (after the kind: 'an integer >= 1'), `text` instead of
    kind and rule where the value is not one number."""

    rule: str
    ok: Callable[[Any], bool]
    text: str | None = None
    limit: str = ""  # the upper limit's words, after the rule

    def expected(self, hint: Any) -> str:
        if self.text:
            return self.text
        kind = "an integer" if hint is int else ("a number" if self.rule.startswith("in ") else "a finite number")
        return f"{kind} {self.rule}{self.limit}"


def at_least(low: float) -> Bound:
    return Bound(f">= {low}", lambda value: low <= value < math.inf)


def above(low: float) -> Bound:
    return Bound(f"> {low}", lambda value: low < value < math.inf)


FLOAT32_LIMIT = ", at most 3.4e38 (float32's largest)"


def in_float32(bound: Bound) -> Bound:
    """`bound`, and at most FLOAT32_MAX: a number that becomes a tensor or an optimizer's hyper-parameter."""
    return Bound(bound.rule, lambda value: bound.ok(value) and value <= FLOAT32_MAX, limit=FLOAT32_LIMIT)


# A dataset split's name as Hugging Face `datasets` allows it (`datasets.splits`'s pattern).
SPLIT_NAME = re.compile(r"\w+(\.\w+)*")
SHARE = Bound("in [0, 1)", lambda value: 0 <= value < 1)
# A seed: numpy's generators take none below 0, torch's none of 2**64 or more (and 64 bits go into JSON and hashes).
SEED = Bound("in [0, 2**63 - 1]", lambda value: 0 <= value < 2**63)

# Every number's range by "section.key"; an unset (None) key is not checked.
BOUNDS: dict[str, Bound] = {
    "data.seq_len": at_least(1), "data.batch_size": at_least(1), "data.eval_fraction": SHARE,
    "data.eval_tokens": at_least(0), "data.max_samples": at_least(0), "data.samples_per_shard": at_least(0),
    "blocks.memory_budget": at_least(1), "blocks.blocks": at_least(1), "blocks.start_block": at_least(0),
    "blocks.sweeps": at_least(1), "blocks.importance_batches": at_least(1), "blocks.importance_floor": at_least(1),
    "blocks.importance_margin": at_least(0), "blocks.experts_sample": at_least(1),
    "blocks.expand_rank": at_least(1), "blocks.expand_lr": in_float32(above(0)),
    "optim.lr": in_float32(above(0)), "optim.momentum": in_float32(at_least(0)),
    "optim.weight_decay": in_float32(at_least(0)),
    "optim.betas": Bound("", lambda betas: len(betas) == 2 and all(0 <= b < 1 for b in betas),
                         text="two numbers in [0, 1)"),
    "optim.warmup_steps": at_least(0), "optim.warmup_ratio": SHARE, "optim.grad_clip": in_float32(at_least(0)),
    "optim.grad_accum": at_least(1),
    "stop.steps_per_visit": at_least(1), "stop.epochs_per_visit": above(0), "stop.patience": at_least(1),
    "stop.min_delta": at_least(0), "stop.smoothing": SHARE, "stop.gain_window": at_least(1),
    "stop.total_steps": at_least(1),
    "run.seed": SEED, "run.checkpoint_every": at_least(0), "run.pipeline": at_least(1),
    "run.microbatches": at_least(0), "run.outer_lr": in_float32(above(0)), "run.outer_momentum": SHARE,
    "run.loss_chunk": at_least(1),
}


def type_problem(value: Any, hint: Any) -> str | None:
    """What a value of the (plain) type `hint` was expected to be, or None when it is one."""
    allowed = choices_of(hint)
    if is_names(hint):
        listed = names(value) if isinstance(value, str) else None
        if listed is None or not set(listed) <= set(allowed) or len(set(listed)) < len(listed):
            return f"a comma list of {', '.join(allowed)}, each named once"
    elif get_origin(hint) is Literal:
        if value not in allowed:
            return f"one of {', '.join(allowed)}"
    elif get_origin(hint) is list:
        if not isinstance(value, list) or not all(is_number(item) for item in value):
            return "a list of numbers"
    elif hint is float:
        if not is_number(value):
            return "a number"
    elif not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        return {int: "an integer", str: "a string", bool: "true or false"}.get(hint, hint.__name__)
    return None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


Problem = tuple[str, str, str]  # the section and key that break a rule, and what was expected of it


def key_problems(config: Any) -> Iterator[Problem]:
    """Each key's type, choices and range."""
    for section in fields(config):
        values = getattr(config, section.name)
        for item in fields(values):
            value, hint = getattr(values, item.name), field_hint(type(values), item.name)
            if value is None and is_optional(type(values), item.name):
                continue
            expected = type_problem(value, hint)
            bound = BOUNDS.get(f"{section.name}.{item.name}")
            if expected is None and bound is not None and not bound.ok(value):
                expected = bound.expected(hint)
            if expected is not None:
                yield section.name, item.name, expected


def rule_problems(c: Any) -> Iterator[Problem]:
    """The rules between keys. Another key is written {section.key}, which the message names as its source does."""
    b, o, s, r = c.blocks, c.optim, c.stop, c.run
    visit_length = s.steps_per_visit is not None or s.epochs_per_visit is not None
    if s.steps_per_visit is None and s.epochs_per_visit is None and s.patience is None:
        yield "stop", "steps_per_visit", "a stopping rule: {stop.steps_per_visit}, {stop.epochs_per_visit} or " \
                                         "{stop.patience}"
    if o.warmup_ratio and o.warmup_steps:
        yield "optim", "warmup_ratio", "0 when {optim.warmup_steps} is given (one of the two)"
    if o.warmup_ratio and not visit_length:
        yield "optim", "warmup_ratio", "0 when a visit ends on a plateau (it has no known last step): give " \
                                       "{optim.warmup_steps}, or a visit length, {stop.steps_per_visit} or " \
                                       "{stop.epochs_per_visit}"
    if o.decay not in OPEN_ENDED_DECAYS and not visit_length:
        yield "optim", "decay", f"one of {', '.join(OPEN_ENDED_DECAYS)} when a visit ends on a plateau (it has " \
                                "no known last step), or a visit length: {stop.steps_per_visit} or " \
                                "{stop.epochs_per_visit}"
    if o.name in LOW_BIT_OPTIMIZERS and not torchao_installed():
        yield "optim", "name", "sgd, adam or adamw: its 8-bit moments need torchao, which is not installed " \
                               "(pip install preinfer[quant])"
    yield from fused_step_problems(c)
    yield from loss_problems(c)
    if o.block_lr is not None and not _parses(parse_block_lr, o.block_lr):
        yield "optim", "block_lr", GRAMMAR
    else:
        yield from rate_problems(c)
    if s.rule == "gain" and b.order not in IMPORTANCE_ORDERS:
        yield "stop", "rule", "budget unless {blocks.order} is " + " or ".join(IMPORTANCE_ORDERS) + \
                              " (the gain rule predicts other blocks' gains from their scores)"
    if b.start_block is not None and b.order in IMPORTANCE_ORDERS:
        yield "blocks", "start_block", f"unset with {{blocks.order}} {b.order} (its sweeps begin with the block " \
                                       f"that scores highest)"
    if b.order == "fixed" and b.fixed_order is None:
        yield "blocks", "order", "a block list in {blocks.fixed_order} with order fixed, e.g. 2,0,1"
    if b.fixed_order is not None and not all(part.strip().isdigit() for part in b.fixed_order.split(",")):
        yield "blocks", "fixed_order", "a comma list of block numbers such as 2,0,1"
    if b.experts is not None and not _parses(parse_experts, b.experts):
        yield "blocks", "experts", "top:SHARE with SHARE in (0, 1], e.g. top:0.5"
    yield from data_problems(c)
    yield from partition_problems(c)
    yield from frozen_dtype_problems(c)
    yield from stream_frozen_problems(c)
    yield from masters_problems(c)
    yield from expand_problems(c)
    if r.pipeline > 1:
        yield from pipeline_problems(c)
    yield from dp_sync_problems(c)


def _parses(parse: Callable[[str], Any], text: str) -> bool:
    """Whether `parse` takes `text` (a parser that refuses with a UsageError)."""
    try:
        parse(text)
    except UsageError:
        return False
    return True


def rate_problems(c: Any) -> Iterator[Problem]:
    """Every step an optimizer takes fits in float32: the largest block's rate, its first Adam step (the rate over
    1 - beta1, Adam's bias correction at step 1) and its decoupled weight decay (the rate times the decay)."""
    o = c.optim
    rate = (o.lr if o.lr is not None else DEFAULT_LR[o.name]) * (
        parse_block_lr(o.block_lr).largest() if o.block_lr is not None else 1.0)
    step = rate if o.name == "sgd" else rate / (1 - o.betas[0])
    decay = rate * (o.weight_decay or 0.0)
    if max(step, decay) > FLOAT32_MAX:
        of = "{optim.lr}" + (" x the largest factor of {optim.block_lr}" if o.block_lr is not None else "")
        taken = "" if o.name == "sgd" else " / (1 - beta1)"
        yield "optim", "lr", f"a rate whose steps fit in float32: {of}{taken} is {step:.3g} and times " \
                             f"{{optim.weight_decay}} {decay:.3g}, where float32's largest is 3.4e38"


def data_problems(c: Any) -> Iterator[Problem]:
    """The dataset split's name, and a named chat template only where the tokenizer's own is used."""
    if not SPLIT_NAME.fullmatch(c.data.dataset_split):
        yield "data", "dataset_split", "a split name such as train, validation or test (letters, digits, _ and .)"
    if c.model.chat_template_name is not None and not c.model.chat_template_name:
        yield "model", "chat_template_name", "the name of one of the tokenizer's chat templates"
    if c.model.chat_template_name is not None and c.model.chat_template is not None:
        yield "model", "chat_template_name", "unset with {model.chat_template} (name a template of that file as " \
                                             "FILE#NAME)"


def partition_problems(c: Any) -> Iterator[Problem]:
    """The block partition's: a UFP, and the memory budget that only `ufp = "auto"` reads."""
    b = c.blocks
    if b.ufp is not None and b.ufp != "auto" and not _parses(parse_ufp, b.ufp):
        yield "blocks", "ufp", "auto or a fraction in (0, 1] such as 1/3"
    if b.ufp != "auto":
        for key in ("memory_budget", "gpu"):
            if getattr(b, key) is not None:
                yield "blocks", key, "unset without {blocks.ufp} auto (which chooses the blocks by it)"
    if b.gpu is not None:
        from preinfer.memory.settings import GPUS  # it imports this package

        if b.gpu not in GPUS:
            yield "blocks", "gpu", f"one of {', '.join(GPUS)}"
    chosen = b.ranges is None and b.blocks is None and b.active is None and c.run.mode == "bcd"
    if chosen and b.ufp == "auto" and (b.memory_budget is None) == (b.gpu is None):
        yield "blocks", "ufp", "a fraction, or auto with exactly one of {blocks.memory_budget} and {blocks.gpu}"


def expand_problems(c: Any) -> Iterator[Problem]:
    """Landscape expansion's: what an explicit expansion does not run with (auto resolves to none there)."""
    if c.blocks.expand not in ("auto", "none"):
        yield from expand_conflicts(c, c.blocks.expand)


def expand_conflicts(c: Any, expand: str) -> Iterator[Problem]:
    """What expansion `expand` (lowrank or sgd) does not run with in config `c`."""
    b = c.blocks
    if b.active is not None:
        yield "blocks", "expand", "none with {blocks.active} (it keeps the layers above the active block frozen)"
    if c.model.masters == "disk":
        yield "blocks", "expand", "none with {model.masters} disk (a visit writes only its own block's masters)"
    if expand == "sgd" and c.run.dp_sync != "step":
        yield "blocks", "expand", "lowrank or none with {run.dp_sync} " + c.run.dp_sync + " (the sgd step updates " \
                                  "the layers above the block, which the replicas' average does not cover)"
    if expand == "sgd" and c.run.precision == "fp16-mixed":
        yield "blocks", "expand", "lowrank or none under {run.precision} fp16-mixed (the sgd step does not " \
                                  "unscale the suffix's gradients)"


def resolved_expand(c: Any, sparse: bool = False) -> str:
    """[blocks] expand with auto resolved: lowrank in a BCD run of a dense model (not `sparse`, nor with
    {blocks.experts}: a mixture of experts, whose fused experts it would not reach) where nothing it does not run
    with is set and where it was measured (without {optim.keep_state}: lowrank runs with kept moments, but its gain
    there is not measured), else none. The one rule of `auto`: the trainer (`preinfer.expansion.expansion_of`), the
    planner (`preinfer.memory.expansion`) and the run record (`preinfer.config.resolved`) all resolve it here."""
    if c.blocks.expand != "auto":
        return c.blocks.expand
    runs = c.run.mode == "bcd" and not (sparse or c.blocks.experts) and not c.optim.keep_state and \
        not any(expand_conflicts(c, "lowrank"))
    return "lowrank" if runs else "none"


def pipeline_problems(c: Any) -> Iterator[Problem]:
    """A pipeline's: micro-batches that split the batch and fill the schedule, and what it does not run."""
    r, batch = c.run, c.data.batch_size
    microbatches = r.microbatches or r.pipeline
    if batch % microbatches:
        yield "run", "microbatches", f"a divisor of {{data.batch_size}} {batch} (0: as many as {{run.pipeline}})"
    elif r.pipeline_schedule == "1f1b" and microbatches < r.pipeline:
        yield "run", "microbatches", "at least {run.pipeline} under {run.pipeline_schedule} 1f1b; or gpipe"
    if c.pre_inference.mode == "on" and c.pre_inference.dask:
        yield "pre_inference", "dask", "unset on a pipeline (its stages build the stores)"
    if r.loss == "liger":
        yield "run", "loss", "auto, chunked or plain on a pipeline (its stages do not run Liger's kernel)"


class _Keys:
    """`{section.key}` in a rule's text: the key as `naming` names it."""

    def __init__(self, naming: Naming, section: str):
        self.naming, self.section = naming, section

    def __getattr__(self, key: str) -> str:
        return self.naming.key(self.section, key)


def check(config: Any, naming: Naming | None = None, more: Iterable[Problem] = ()) -> None:
    """Refuse the first key that breaks a rule (those of `more` after the config's own), in one line: the key and
    its value as `naming` names them, and what was expected."""
    naming = naming or Naming()
    for section, key, expected in chain(key_problems(config), rule_problems(config), more):
        keys = {item.name: _Keys(naming, item.name) for item in fields(config)}
        value = getattr(getattr(config, section), key)
        raise UsageError(f"{naming.value(section, key, value)}: expected {expected.format(**keys)}")
