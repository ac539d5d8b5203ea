"""A profile's sections kept as they come, so a profile cut off by its timeout resumes."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("codesign.profile")


class Parts:
    """The sections measured so far (name -> JSON data), written to `path` after each one (a
    temporary file, then renamed: a kill leaves the previous version whole)."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        if self.data:
            log.info("resuming from %s: %s", path, ", ".join(self.data))

    def get(self, name: str, measure: Callable[[], Any]) -> Any:
        """The section's data: kept from an earlier run, else measured now and saved."""
        if name not in self.data:
            start = time.perf_counter()
            self.keep(name, measure())
            log.info("  (%s measured in %.1f s)", name, time.perf_counter() - start)
        return self.data[name]

    def keep(self, name: str, data: Any) -> None:
        """Save a section's data, measured with another's."""
        self.data[name] = data
        scratch = self.path.with_name(self.path.name + ".tmp")
        scratch.write_text(json.dumps(self.data))
        os.replace(scratch, self.path)
