"""The example training scripts (`python -m ftsup.trainer.examples.gpt`, the reference trainer, and its neighbours).

They need torch and numpy, which come with the trainer extra: without them this package names the extra to
install (`ftsup.extras`) instead of failing at its first `import torch`.
"""

from ftsup import extras

extras.require("trainer", "python -m ftsup.trainer.examples")
