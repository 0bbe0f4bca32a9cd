"""Code the test modules share (no test module imports another): corpora, the caching job's helpers, trainers and
training runs, command-line runs."""
