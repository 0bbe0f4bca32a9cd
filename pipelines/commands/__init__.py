"""One module per `preinfer` subcommand."""
