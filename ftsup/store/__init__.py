"""The checkpoint store: the on-disk format both sides of ftsup read, stdlib only.

The supervisor lists, verifies and chooses from it; the engine (`ftsup.trainer.checkpoint`) writes it. Its
modules, format and rules for a hostile store: ftsup/store/DESIGN.md.
"""
