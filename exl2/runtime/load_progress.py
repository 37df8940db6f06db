"""Load progress: a callback told of each decoder layer as a model loads (exllamav2's `callback(idx, total)`).

`load_model(progress=...)` and `Engine(config, progress=...)` take one; the model builders report through
`report`, so the split and tensor-parallel builders need no extra argument. The callback runs on the loading
thread and must not raise."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

Progress = Callable[[int, int], None]
_CALLBACK: ContextVar[Optional[Progress]] = ContextVar("exl2_load_progress", default=None)


@contextmanager
def reporting(callback: Optional[Progress]) -> Iterator[None]:
    """Within the block, `report` calls `callback` (None: keep the callback already set, if any)."""
    if callback is None:
        yield
        return
    token = _CALLBACK.set(callback)
    try:
        yield
    finally:
        _CALLBACK.reset(token)


def tagged(progress: Optional[Callable[[str, int, int], None]], kind: str) -> Optional[Progress]:
    """`progress(kind, done, total)` (Engine's form, which names the model: "model" or "draft") as a `Progress`;
    None stays None."""
    return None if progress is None else (lambda done, total: progress(kind, done, total))


def report(done: int, total: int) -> None:
    """`done` of `total` modules (decoder layers, then the head) are loaded."""
    callback = _CALLBACK.get()
    if callback is not None:
        callback(done, total)
