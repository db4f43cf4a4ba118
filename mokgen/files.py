"""Files written whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> Path:
    """Write text to path through a temporary file in the same folder (named by this process,
    so concurrent writers do not share one) and one rename: a reader, or the next run after a
    crash, sees the old file or the new one, never half of one. Creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
