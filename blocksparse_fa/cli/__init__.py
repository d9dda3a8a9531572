"""The ``bsfa`` command line. Each module here with a ``register(subparsers)`` function adds a subcommand."""
