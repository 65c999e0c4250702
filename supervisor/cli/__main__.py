"""`python -m ftsup.supervisor.cli ...`: the same as `ftsup ...`."""

from __future__ import annotations

import sys

from ftsup.supervisor.cli.commands import main

sys.exit(main())
