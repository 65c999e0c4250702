"""Lightning interop: `FtsupLightningCallback` (`callback`), a Lightning `Trainer` under ftsup."""
