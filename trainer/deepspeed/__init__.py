"""DeepSpeed interop: its checkpoint tags checked before a resume, its engine supervised, its checkpoints converted."""
