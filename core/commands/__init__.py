"""Subcommands of the ``polyspec`` CLI, one module each.

A command module exposes two functions:

- ``add_parser(subparsers) -> None``: add its sub-parser (name, help, flags) to the
  ``argparse`` sub-parsers object;
- ``run(args: argparse.Namespace) -> int``: do the work and return the exit status.

Modules import heavy dependencies (models, engine, vendor runtimes through a backend) inside
``run``, so that building the parser, ``--help`` and ``polyspec backends`` stay cheap. A
command reports a user error by raising :class:`polyspec.errors.PolyspecError`; the CLI prints
it as ``polyspec: error: <message>`` and exits with status 2.
"""
