"""Progress bars (rich) with time left per stage, and one-line messages; silent when `quiet`."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Callable, Iterator


class Reporter:
    """`quiet` silences everything; `messages=False` drops the ` -- ` lines but keeps bars and warnings (for callers
    that announce the job themselves in one line)."""

    def __init__(self, quiet: bool = False, messages: bool = True):
        self.quiet, self.messages = quiet, messages
        self._console = None
        if not quiet:
            from rich.console import Console

            self._console = Console(stderr=True)

    def info(self, msg: str) -> None:
        if self._console is not None and self.messages:
            self._console.print(f" -- {msg}", highlight=False)

    def warn(self, msg: str) -> None:
        if self._console is not None:
            self._console.print(f" !! warning: {msg}", style="yellow", highlight=False)
        elif not self.quiet:
            print(f"warning: {msg}", file=sys.stderr)

    @contextmanager
    def stage(self, description: str, total: int, done: int = 0) -> Iterator[Callable[[int], None]]:
        """A bar for one stage; yields `tick(n=1)`."""
        if self._console is None:
            yield lambda n=1: None
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                   TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
        with Progress(*columns, console=self._console) as bar:
            task = bar.add_task(description, total=total, completed=done)
            yield lambda n=1: bar.advance(task, n)


class StatusReporter(Reporter):
    """`exl2 convert -so`: progress for a program driving the converter, as one JSON object a line on stdout
    (`{"event": "stage" | "progress" | "stage_end", "stage", "done", "total"}`, `{"event": "message" |
    "warning", "text"}`), no bars."""

    def __init__(self):
        super().__init__(quiet=True)

    def _emit(self, **obj) -> None:
        print(json.dumps(obj), flush=True)

    def info(self, msg: str) -> None:
        self._emit(event="message", text=msg)

    def warn(self, msg: str) -> None:
        self._emit(event="warning", text=msg)

    @contextmanager
    def stage(self, description: str, total: int, done: int = 0) -> Iterator[Callable[[int], None]]:
        name, count = description.strip(), [done]
        self._emit(event="stage", stage=name, done=done, total=total)

        def tick(n: int = 1) -> None:
            count[0] += n
            self._emit(event="progress", stage=name, done=count[0], total=total)

        yield tick
        self._emit(event="stage_end", stage=name, done=count[0], total=total)
