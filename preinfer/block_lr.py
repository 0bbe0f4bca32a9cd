"""Per-block learning rates (`--block-lr`): each block trains at its own factor of the run's rate.

The grammar is one of two forms, each a factor of `--lr` (or of the optimizer's default rate):

- `depth:LO..HI`: linear in the block's index, LO at the first block of the partition and HI at the last (one
  block: LO); e.g. `depth:0.5..1.5`;
- a comma list of factors, one per block in the partition's order; e.g. `1,0.5,0.5`.

Every factor is a number > 0 that float32 holds (at most FLOAT32_MAX), and so is every block's resolved factor (a
depth rule's lie between LO and HI); `preinfer.config.rules` bounds the rate they multiply. A visit's rate (its schedule's full rate, the step and visit records' `lr`)
is the factor of its block times the rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from preinfer.errors import UsageError

# float32's largest finite value (`torch.finfo(torch.float32).max`, written out: the config's rules load no torch).
# A rate, or a factor of it, above it cannot become an optimizer's step ("value cannot be converted to type float").
FLOAT32_MAX = 3.4028234663852886e38
GRAMMAR = "depth:LO..HI or a comma list of factors > 0, one per block (e.g. depth:0.5..1.5 or 1,0.5,0.5), each " \
          "at most 3.4e38 (float32's largest)"


@dataclass(frozen=True)
class BlockRates:
    """A parsed `--block-lr`: a depth rule (`low`, `high`) or an explicit list of factors."""

    text: str
    listed: tuple[float, ...] = ()
    low: float = 1.0
    high: float = 1.0

    def factors(self, blocks: int) -> list[float]:
        """Each of `blocks` blocks' factor; a list of another length is refused."""
        if not self.listed:
            step = (self.high - self.low) / (blocks - 1) if blocks > 1 else 0.0
            return [self.low + step * index for index in range(blocks)]
        if len(self.listed) != blocks:
            raise UsageError(f"--block-lr {self.text}: lists {len(self.listed)} factors but the partition has "
                             f"{blocks} blocks; give {blocks}, or a rule depth:LO..HI")
        return list(self.listed)

    def largest(self) -> float:
        """The largest factor any block can get (a depth rule's lie between LO and HI)."""
        return max(self.listed) if self.listed else max(self.low, self.high)


def parse_block_lr(text: str) -> BlockRates:
    """`text` as `BlockRates`, or a one-line UsageError naming the grammar."""
    kind, colon, rest = text.partition(":")
    parts = rest.split("..") if colon else text.split(",")
    if (colon and (kind.strip() != "depth" or len(parts) != 2)) or not all(_factor(p) for p in parts):
        raise UsageError(f"--block-lr {text!r}: expected {GRAMMAR}")
    values = tuple(float(p) for p in parts)
    return BlockRates(text, low=values[0], high=values[1]) if colon else BlockRates(text, listed=values)


def _factor(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return 0 < value <= FLOAT32_MAX
