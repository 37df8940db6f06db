"""Names given for a directory entry under a root (the server's models, LoRAs, sampler presets; chat templates)."""
from __future__ import annotations

from pathlib import Path, PureWindowsPath


def plain_name(name: str) -> bool:
    """Whether `name` is an entry name that stays inside the directory it is looked up in (no separator, drive,
    absolute path or leading dot)."""
    return (bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0:")
            and not PureWindowsPath(name).drive and not Path(name).is_absolute())
