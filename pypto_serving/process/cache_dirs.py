"""Where the project keeps what it can rebuild: `$XDG_CACHE_HOME/pypto-serving/NAME`, else
`~/.cache/pypto-serving/NAME` (joined packaged models, compiled kernels, packed weights,
tokenizer merges). Read when asked, so a changed environment counts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str = "") -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "pypto-serving" / name
