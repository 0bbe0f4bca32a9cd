"""What the benchmarks share: output and timing helpers, the runs they compare, curves, a pretrained checkpoint."""
