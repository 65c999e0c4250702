"""The run loop and its adapters: the daemon, attempts and workers, heartbeats, resume, launch."""
