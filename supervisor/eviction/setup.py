"""Build the configured watchers (providers, file, command) for the daemon."""

from __future__ import annotations

from pathlib import Path

from ftsup.supervisor.config.job import EvictionConfig
from ftsup.supervisor.eviction.local import CommandWatcher, FileWatcher
from ftsup.supervisor.eviction.providers import AwsWatcher, AzureWatcher, GcpWatcher
from ftsup.supervisor.eviction.runner import Watcher

_DMI_VENDOR = Path("/sys/class/dmi/id/sys_vendor")
_VENDORS = {"amazon": "aws", "google": "gcp", "microsoft": "azure"}


def detect_provider(vendor_file: Path = _DMI_VENDOR) -> str | None:
    """The cloud this machine runs on, from its DMI vendor string (None: not a known cloud)."""
    try:
        vendor = vendor_file.read_text().strip().lower()
    except OSError:
        return None
    return next((p for key, p in _VENDORS.items() if key in vendor), None)


def build_watchers(cfg: EvictionConfig) -> list[Watcher]:
    providers = list(cfg.providers)
    if "auto" in providers:
        found = detect_provider()
        providers = [found] if found else []
    watchers: list[Watcher] = []
    classes = {"aws": AwsWatcher, "gcp": GcpWatcher, "azure": AzureWatcher}
    for name in providers:
        watchers.append(classes[name](cfg.endpoint, cfg.default_deadline_s))
    if cfg.file is not None:
        watchers.append(FileWatcher(cfg.file, cfg.default_deadline_s))
    if cfg.command:
        watchers.append(CommandWatcher(cfg.command, cfg.default_deadline_s))
    return watchers
