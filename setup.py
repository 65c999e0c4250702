"""What pyproject.toml cannot declare: the packages under `ftsup`, and the C extension.

The folders `supervisor/` and `trainer/` are installed as `ftsup.supervisor` and `ftsup.trainer`;
the shared core (`ftsup.store`, the checkpoint format both sides read) lives in `ftsup/` itself.
Every subpackage is found here, so that a new one is never left out of a wheel. The mapping is
given here rather than in pyproject.toml's package-dir: from there, an editable install copies a
mapped package's built extensions to `ftsup/trainer/...` instead of `trainer/...`.

`ftsup.store._blocksum` (hardware CRC-32C, see ftsup/store/DESIGN.md) is built by `pip install`
with the system C compiler and the Python headers. It is optional: where it cannot be built,
ftsup still installs and computes the same checksums in pure Python, much more slowly, and the
checkpoint engine logs `checkpoint_checksums_slow`.
"""

from setuptools import Extension, find_packages, setup

PACKAGES = find_packages(include=["ftsup", "ftsup.*"]) + [
    f"ftsup.{name}" for name in find_packages(include=["supervisor", "supervisor.*", "trainer", "trainer.*"])
]

setup(
    packages=PACKAGES,
    package_dir={"ftsup.supervisor": "supervisor", "ftsup.trainer": "trainer"},
    ext_modules=[
        Extension(
            "ftsup.store._blocksum",
            sources=["ftsup/store/_blocksum.c"],
            optional=True,
        )
    ],
)
