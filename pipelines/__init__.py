"""Jobs that join the model side (`preinfer`) and the stores (`storage`): caching, training, planning, the CLI.

Importing it changes nothing in the process: process-wide settings belong to the command line (`pipelines.cli`).

Its parts stand on floors, lowest first; a part imports only the floors below it, never a part beside it
(tests/test_import_graph.py):

1. the wiring every job shares: `jobs` (how a command ends on an error, the output a job holds), `progress` (the
   progress display), `flags` (the flags and a run's config from them: `flag_types`, `flag_table`,
   `command_flags`, `flags`);
2. `models`: loading a model, a suffix or a stage, and exporting one;
3. `data`: corpora, tokenizers, samples and the token store;
4. `cache`: the caching job (stores of boundary states) and a run's shard size;
5. `pre_inference`: which visits read a store, and the stores a run makes;
6. `pipeline_parallel`: a run's stages on a pipeline;
7. `training`: the one run path of `bcd` and `train` (its run directory and inputs too), and `store_training` (a
   loop of one's own over a cache's stores);
8. `commands`: one module per command;
9. `cli`: the command line; `families_doc` (the families page of the docs);
10. `reference`: the generated reference pages (it reads the command line).
"""
