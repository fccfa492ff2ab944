"""Subcommands of ``dtkv``; see ``cli.py`` for the plug-in convention."""
