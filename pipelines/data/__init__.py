"""The data path: corpora read lazily, tokenizers, samples, the token store and the batch sources."""
