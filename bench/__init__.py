"""The benchmarks: each runs from the repository root as `python -m bench.NAME`; bench.lib holds what they share."""
