"""The tests' cloud metadata server is the fault tooling's (`ftsup.tools.faults.metadata_server`)."""

from ftsup.tools.faults.metadata_server import MetadataServer, MetadataState

__all__ = ["MetadataServer", "MetadataState"]
