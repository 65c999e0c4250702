"""Auto-instrumentation: what `ftsup run` gives a training script without a line of ftsup in it.

The ranks' start-up hook (`site/sitecustomize.py`) installs `startup`; the rest is imported when the script imports
what it instruments (docs/design/auto-instrumentation.md).
"""
