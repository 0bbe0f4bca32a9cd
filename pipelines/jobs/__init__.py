"""The wiring every job shares, so that `eval`, `cache`, `verify`, `tokenize`, `bcd` and `train` each get it the
same way: how a command ends on an error (`pipelines.jobs.errors`: one line and exit code 2 for bad input, 1 at run
time) and the output a job holds (`pipelines.jobs.output`: refused if it is a file, owner-locked for the whole job);
beside it on the lowest floor, the progress display (`pipelines.progress.Progress`). A run directory as `bcd` and
`train` hold it is `pipelines.training.run_directory`.

The package imports nothing itself: the command line reads `errors` before any command loads torch."""
