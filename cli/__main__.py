"""``python -m cli``: the `conveyor` command without its installed script."""
from __future__ import annotations

import sys

from cli.main import main

sys.exit(main())
