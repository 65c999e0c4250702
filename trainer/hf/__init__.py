"""Hugging Face interop: the Trainer callback, its checkpoints in the store, Hub-layout import and export."""
