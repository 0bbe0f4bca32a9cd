"""Jobs that join the model side (`preinfer`) and the stores (`storage`): caching, training, planning, the CLI.

Importing it changes nothing in the process: process-wide settings belong to the command line (`pipelines.cli`).
"""
