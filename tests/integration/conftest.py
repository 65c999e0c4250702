"""Fixtures shared by the integration tests: the real S3 store's (`tests/s3fixtures.py`)."""

from tests.s3fixtures import bucket, s3_server

__all__ = ["bucket", "s3_server"]
