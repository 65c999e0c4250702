"""PyTorch Distributed Checkpoint (DCP) interop: a run started from a DCP checkpoint, and export to one."""
