"""Bytes per GPU: of full-parameter Adam, of each BCD visit (live or from a store) and of a pipeline stage (its own
card), and the automatic partition: the fewest visits that fit, the ends inside or apart, on one GPU or the
smallest pipeline."""

from __future__ import annotations

from dataclasses import dataclass, replace

from preinfer.memory.activations import StepActs, loss_workspace, step_activations
from preinfer.memory.expansion import expanded
from preinfer.memory.layer_spans import LayerSpan, block_params, partition
from preinfer.memory.quantized import active_state, adjust, block_tensors, frozen_weights
from preinfer.memory.settings import DTYPES, Settings
from preinfer.memory.shapes import ModelShape
from preinfer.memory.streaming import streamed


@dataclass
class Memory:
    """Bytes per GPU of one configuration, by component, and whether it fits."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int = 0
    fits: bool = False
    note: str = ""
    host: int = 0  # host memory: the masters of frozen weights held in fewer bits (none on disk), the streamed
    # frozen layers and offloaded checkpoints (in the total on a CPU device)
    step: int = 0  # a moment's temporaries beyond the held tensors and the activations freed by then (`transients`)

    @property
    def held(self) -> int:
        """Bytes of the tensors the visit holds (what the memory meter measures): the total without `step`."""
        return self.total - self.step

    def finish(self, settings: Settings) -> Memory:
        """Fill in the total (the host masters too where the device is the host) and whether it fits."""
        self.total = self.weights + self.grads + self.optimizer + self.activations + self.step
        self.total += self.host if settings.host_device else 0
        self.fits = self.total <= settings.capacity()
        return self


def step_temporaries(m: ModelShape, settings: Settings, span: LayerSpan, activations: int) -> int:
    """Bytes torch's Adam and AdamW step allocates for a moment beyond the `activations` backward has freed by then.
    Its denominator sqrt(v) / c + eps is new memory: on a CPU device the single-tensor step builds it one tensor at
    a time from two temporaries that tensor's size (`sqrt`, then the division), on CUDA the multi-tensor (foreach)
    step builds it for every trainable tensor at once. Not counted: SGD's step (in place), the 8-bit optimizers'
    (its float32 temporaries are one tensor's), and the fused step's, which runs tensor by tensor during backward.
    Dense layers' tensors (`block_tensors`); 0 for a sparse model."""
    if settings.optimizer not in ("adam", "adamw") or settings.fused_step or m.sparse:
        return 0
    tensors, moment = block_tensors(m, span), DTYPES[settings.dtype]["moments"] // 2
    temporaries = 2 * max(tensors) * moment if settings.host_device else sum(tensors) * moment
    return max(0, temporaries - activations)


def tied_gradients(m: ModelShape, settings: Settings, span: LayerSpan, activations: int) -> int:
    """Bytes a tied embedding's backward holds for a moment beyond its one gradient and the `activations` freed by
    then: the head's gradient of the weight, the embedding's, and their sum are alive together (in the resident
    dtype; measured: 3.0x the weight's bytes over a backward's baseline). 0 unless `span` trains the tied weight."""
    if not (m.tied and span.embed):
        return 0
    return max(0, 2 * m.vocab * m.hidden * DTYPES[settings.dtype]["weight"] - activations)


def transients(m: ModelShape, settings: Settings, span: LayerSpan, activations: int) -> int:
    """The largest of a visit's temporaries, each at its own moment: the loss's backward (at its start, every
    activation held), the optimizer step's (after backward) and a tied embedding's gradients (at the end of
    backward)."""
    loss = loss_workspace(m, settings.micro_batch, settings.seq_len, DTYPES[settings.dtype]["act"], settings.chunk())
    return max(loss, step_temporaries(m, settings, span, activations), tied_gradients(m, settings, span, activations))


def activations(m: ModelShape, settings: Settings, active: LayerSpan | None, recompute: bool,
                plain_loss: bool = False) -> StepActs:
    """The activations of one step of `settings` with `active` training (None: full Adam); `plain_loss`: with the
    plain loss whatever `settings.loss` says."""
    chunk = None if plain_loss else settings.chunk()
    return step_activations(m, settings.micro_batch, settings.seq_len, DTYPES[settings.dtype]["act"], active,
                            recompute, settings.attention, chunk, settings.offload and recompute)


def _component_bytes(settings: Settings, resident: int, trainable: int) -> tuple[int, int, int]:
    """Weights, gradient and optimizer-state bytes of `resident` and `trainable` parameter counts (SGD keeps one
    momentum buffer where Adam keeps two moments)."""
    d = DTYPES[settings.dtype]
    moments = d["moments"] // 2 if settings.optimizer == "sgd" else d["moments"]
    return resident * d["weight"], trainable * d["grad"], trainable * (d["master"] + moments)


def full_memory(m: ModelShape, settings: Settings, recompute: bool) -> Memory:
    """Full-parameter Adam on one GPU (with the 8-bit optimizer and the fused step where set; no layer is frozen)."""
    n = m.total_params()
    acts = activations(m, settings, None, recompute)
    weights, grads, optimizer = _component_bytes(settings, n, n)
    everything = LayerSpan(0, m.layers, True, True)
    grads, optimizer = active_state(m, settings, everything, grads, optimizer)
    step = transients(m, settings, everything, acts.total())
    return Memory(weights, grads, optimizer, acts.total(), host=acts.offloaded, step=step).finish(settings)


def bcd_memory(m: ModelShape, settings: Settings, blocks: list[LayerSpan], k: int, store: bool) -> Memory:
    """BCD-Adam on one GPU while block k trains: live (whole model resident) or from a store (suffix only).

    From a store, only the suffix (layers >= the block's first layer, and the head) is resident; a tied GPT-2
    head keeps the token embedding resident too, since it is the head's weight.
    """
    block = blocks[k]
    resident = m.total_params()
    if store:
        resident = m.span_params(block.start, m.layers) + m.head_params()
        resident += m.vocab * m.hidden if (m.tied and not block.embed) else 0
        resident += m.embed_params() if block.embed else 0
    acts = activations(m, settings, block, settings.recompute)
    first = block.start if store else 0
    weights, grads, optimizer, host = adjust(m, settings, block, first,
                                             _component_bytes(settings, resident, block_params(m, block)))
    weights, host = streamed(m, settings, (block.start - first) + (m.layers - block.stop), weights, host)
    grads, optimizer, acts = expanded(m, settings, block, grads, optimizer, acts)
    step = transients(m, settings, block, acts.total())
    memory = Memory(weights, grads, optimizer, acts.total(), host=host + acts.offloaded, step=step)
    memory.note = f"block {k} ({block_text(block)})"
    return memory.finish(settings)


def block_text(block: LayerSpan) -> str:
    """What a block trains, as a visit's note names it: `layers 0-9`, `the embedding`, `the final norm and head`."""
    if block.stop > block.start:
        return f"layers {block.start}-{block.stop - 1}"
    return "the embedding" if block.embed else "the final norm and head"


def worst_bcd(m: ModelShape, settings: Settings, blocks: list[LayerSpan], store: bool) -> Memory:
    """The visit with the largest footprint (from a store: blocks above the first; block 0 has no prefix)."""
    candidates = range(1 if store and len(blocks) > 1 else 0, len(blocks))
    return max((bcd_memory(m, settings, blocks, k, store) for k in candidates), key=lambda mem: mem.total)


def visit_peaks(m: ModelShape, settings: Settings, blocks: list[LayerSpan], degree: int = 1) -> list[int]:
    """Each live visit's peak bytes per GPU: on one GPU (`bcd_memory`), else its largest stage's on `degree`
    stages (`pipeline_peak`)."""
    if degree == 1:
        return [bcd_memory(m, settings, blocks, k, store=False).total for k in range(len(blocks))]
    return [pipeline_peak(m, settings, [active], degree) for active in blocks]


def pipeline_peak(m: ModelShape, settings: Settings, blocks: list[LayerSpan] | None, degree: int) -> int:
    """Largest per-GPU bytes with `degree` pipeline stages (layers split evenly; None: full Adam).

    1F1B schedule: stage j keeps the activations of (degree - j) micro-batches in flight."""
    visits = [None] if blocks is None else blocks
    return max(stage_bytes(m, settings, stage, active, degree - j)
               for j, stage in enumerate(partition(m, degree)) for active in distinct_visits(stage, visits))


def distinct_visits(stage: LayerSpan, blocks: list[LayerSpan | None]) -> list[LayerSpan | None]:
    """The visits of `blocks` that can differ on `stage`: those holding a part of it, and one of those wholly
    below it and one wholly above (the stage holds the same for each of those: its layers frozen, in the gradient
    path above the active block and running forward only below it)."""
    touching = [active for active in blocks if active is None or _holds_part(stage, active)]
    below = next((a for a in blocks if a is not None and not _holds_part(stage, a) and a.stop <= stage.start), None)
    above = next((a for a in blocks if a is not None and not _holds_part(stage, a) and a.start >= stage.stop), None)
    return touching + [visit for visit in (below, above) if visit is not None]


def _holds_part(stage: LayerSpan, active: LayerSpan) -> bool:
    """Whether `stage` holds a layer or an end of block `active`."""
    return (max(stage.start, active.start) < min(stage.stop, active.stop) or (stage.embed and active.embed)
            or (stage.head and active.head))


def stage_memory(m: ModelShape, settings: Settings, stage: LayerSpan, active: LayerSpan | None,
                 in_flight: int) -> Memory:
    """What one pipeline stage holds while `active` trains (None: full Adam), as its own card: its layers' weights
    (those outside the active block held in the frozen dtype, their masters in host memory), gradients and
    optimizer state (8-bit, fused) for the part of the active block it holds, the activations of `in_flight`
    micro-batches (none below the active block, which runs forward only; the last stage's loss from the whole
    logits, as a pipeline computes it), and the step's temporaries beyond them."""
    acts = activations(m, settings, active, settings.recompute, plain_loss=True)  # a pipeline's loss is plain
    params = block_params(m, stage)
    params += m.vocab * m.hidden if m.tied and stage.head and not stage.embed else 0  # its copy of the tied weight
    if active is None:
        held = stage
    else:
        lo, hi = max(stage.start, active.start), min(stage.stop, active.stop)
        held = LayerSpan(lo, max(lo, hi), stage.embed and active.embed, stage.head and active.head)
    trainable = block_params(m, held)
    weights, grads, optimizer = _component_bytes(settings, params, trainable)
    if trainable:
        grads, optimizer = active_state(m, settings, held, grads, optimizer)
    layers = stage.stop - stage.start
    delta, host = (0, 0) if active is None else \
        frozen_weights(m, settings, layers - (held.stop - held.start), layers)
    stage_acts = acts.total(stage.start, stage.stop, inputs=stage.embed, outputs=stage.head) * in_flight
    step = step_temporaries(m, settings, held, stage_acts) if trainable else 0
    return Memory(weights + delta, grads, optimizer, stage_acts, host=host, step=step).finish(settings)


def stage_bytes(m: ModelShape, settings: Settings, stage: LayerSpan, active: LayerSpan | None, in_flight: int) -> int:
    """Peak bytes of one pipeline stage while `active` trains (`stage_memory`)."""
    return stage_memory(m, settings, stage, active, in_flight).total


def fewest_blocks(m: ModelShape, settings: Settings, degree: int = 1) -> tuple[int, int] | None:
    """The fewest blocks (largest UFP) whose worst live visit fits `settings.capacity()` per GPU with `degree`
    pipeline stages, the ends placed as `settings.separate_ends` says, and that peak in bytes; None when even one
    layer per block does not fit, or on a pipeline with landscape expansion asked for (a stage's share of it is not
    priced yet, though the stages run it; auto is priced as none there)."""
    if degree > 1 and settings.expand not in ("auto", "none"):
        return None
    capacity = settings.capacity()
    if degree > 1 and pipeline_peak(m, settings, partition(m, m.layers, settings.separate_ends), degree) > capacity:
        return None  # a stage's visits of one layer a block are its smallest: a coarser block only adds to each
    for n in range(1, m.layers + 1):
        blocks = partition(m, n, settings.separate_ends)
        peak = max(visit_peaks(m, settings, blocks)) if degree == 1 else pipeline_peak(m, settings, blocks, degree)
        if peak <= capacity:
            return n, peak
    return None


@dataclass(frozen=True)
class Fit:
    """A partition whose every visit fits: `blocks` blocks of layers (`--blocks`), the embedding and the head in
    blocks of their own (`separate_ends`) or inside the first and the last, and the worst visit's bytes per GPU."""

    blocks: int
    separate_ends: bool
    peak: int

    @property
    def visits(self) -> int:
        """Visits of one sweep: the blocks of layers, and the ends' own blocks."""
        return self.blocks + 2 * self.separate_ends


def placements(settings: Settings) -> tuple[bool, ...]:
    """The ends' placements a choice weighs (`separate_ends` of each): apart where `settings` asks for it, else
    inside the first and last block or apart."""
    return (True,) if settings.separate_ends else (False, True)


def best_fit(m: ModelShape, settings: Settings, degree: int = 1) -> Fit | None:
    """The automatic partition on `degree` GPUs: of the ends' placements (`placements`), the one whose fewest
    fitting blocks (`fewest_blocks`) make the fewest visits, the largest share of the model trained in each; on a
    tie the ends inside, so that no visit trains an end alone. None when no placement fits."""
    fits = [Fit(found[0], apart, found[1]) for apart in placements(settings)
            if (found := fewest_blocks(m, replace(settings, separate_ends=apart), degree)) is not None]
    return min(fits, key=lambda fit: fit.visits, default=None)


def auto_choice(m: ModelShape, settings: Settings) -> dict:
    """The automatic partition (`best_fit`) on one GPU, else on the smallest pipeline degree that fits, and each
    of its visits' peak per GPU."""
    for degree in range(1, m.layers + 1):
        fit = best_fit(m, settings, degree)
        if fit is not None:
            blocks = partition(m, fit.blocks, fit.separate_ends)
            return dict(blocks=fit.blocks, ufp=1 / fit.blocks, pipeline_degree=degree, per_gpu_bytes=fit.peak,
                        separate_ends=fit.separate_ends, visits=fit.visits,
                        predicted=visit_peaks(m, settings, blocks, degree))
    return dict(blocks=None, ufp=None, pipeline_degree=None, per_gpu_bytes=None, separate_ends=None, visits=None,
                predicted=None)


def full_pipeline_degree(m: ModelShape, settings: Settings) -> int | None:
    """The smallest pipeline degree at which full-parameter Adam fits (None if not even one layer per GPU)."""
    capacity = settings.capacity()
    return next((p for p in range(1, m.layers + 1) if pipeline_peak(m, settings, None, p) <= capacity), None)
