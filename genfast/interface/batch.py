"""What the batch commands (a file of prompts, a folder of images) report when they end."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Summary:
    """Items answered now, skipped (their outputs were already there) and left out (why, each)."""

    done: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)

    def fail(self, message: str, stream: TextIO | None = None) -> None:
        """Leave an item out, saying why at once."""
        self.failed.append(message)
        print(f"genfast: skipped {message}", file=stream if stream is not None else sys.stderr, flush=True)

    def line(self) -> str:
        return f"done {self.done}, skipped {self.skipped} (already in the output), failed {len(self.failed)}"
