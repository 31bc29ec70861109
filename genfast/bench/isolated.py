"""Running one benchmark row in a fresh interpreter: honest peak memory (the process's own), and no
compiled code or caches shared between rows."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genfast.errors import UserError


def run_row(genfast_args: Sequence[str], what: str) -> dict[str, Any]:
    """Run `python -m genfast *genfast_args --json ROW` and return the row it wrote. Its stdout is
    dropped (the table is the parent's), its stderr shown."""
    with tempfile.TemporaryDirectory(prefix="genfast-bench-row-") as tmp:
        out = Path(tmp) / "row.json"
        done = subprocess.run([sys.executable, "-m", "genfast", *genfast_args, "--json", str(out)],
                              stdout=subprocess.DEVNULL)
        if done.returncode != 0 or not out.exists():
            raise UserError(f"benchmark {what} failed (exit code {done.returncode}); see the error above")
        return json.loads(out.read_text())
