"""A user's own module named like a package ftsup once shipped at the top level; importing it is harmless."""

SHADOW = "the user's supervisor.py"
