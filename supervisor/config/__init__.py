"""The job config: YAML or command-line flags to frozen dataclasses, every error naming its key."""
