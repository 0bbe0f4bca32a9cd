"""Jobs that join the model side (`preinfer`) and the stores (`storage`): caching, training, planning, the CLI."""
