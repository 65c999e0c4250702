"""ftsup's supervisor: the daemon and CLI. Never imports torch (it must outlive the workers)."""
