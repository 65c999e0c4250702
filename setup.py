"""The one thing pyproject.toml cannot declare: the C extension that computes block checksums.

`trainer.checkpoint._blocksum` (hardware CRC-32C, see trainer/checkpoint/DESIGN.md) is built
by `pip install` with the system C compiler and the Python headers. It is optional: where it
cannot be built, ftsup still installs and computes the same checksums in pure Python, much more
slowly, and the checkpoint engine logs `checkpoint_checksums_slow`. Everything else about the
package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trainer.checkpoint._blocksum",
            sources=["trainer/checkpoint/_blocksum.c"],
            optional=True,
        )
    ]
)
