"""ftsup's training-side library: checkpoint engine, resumable state, runtime client.

Submodules are imported on demand; `import trainer` alone imports nothing heavy.
"""
