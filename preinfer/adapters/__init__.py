"""Adapters that stage a model family: `hf` for transformers' causal LMs."""
