"""Progress of a long step (training steps, encoding a corpus, generating answers), one display for every stage.

On a terminal (stderr is a TTY) a rich bar that disappears when the step ends. Anywhere else (a log file,
CI, a pipe) plain timestamped lines on stderr, about every tenth of the way and at least every
`PLAIN_EVERY_S` seconds, with no control characters, so a log reads line by line and greps.

Steps inside steps (a dev evaluation inside training) show as more bars of one display, never as two
displays redrawing over each other. A display that redraws in place on its own (the live panel of
`research run`) holds the terminal with `hold_terminal()`, and bars started meanwhile print plain lines.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO

PLAIN_EVERY_S = 30.0  # a slow step still says it is alive this often when not on a terminal

_held = 0
_lock = threading.Lock()
_shared: Any = None  # the rich Progress every live StepProgress adds its bar to
_users = 0


@contextmanager
def hold_terminal() -> Iterator[None]:
    """While inside, StepProgress prints plain lines instead of a bar (another display redraws the terminal)."""
    global _held
    with _lock:
        _held += 1
    try:
        yield
    finally:
        with _lock:
            _held -= 1


def _fmt_s(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class StepProgress:
    """`total` units of work named `description`; call `advance(n, info)` as they finish and `close()` at the end."""

    def __init__(self, total: int, description: str, *, stream: TextIO | None = None,
                 live: bool | None = None) -> None:
        self.total, self.description, self.done = max(int(total), 1), description, 0
        self.stream = stream if stream is not None else sys.stderr
        if live is None:
            live = _held == 0 and _isatty(self.stream)
        self._next_tenth = 0.1
        self._t0 = self._last_line = time.monotonic()
        self._bar: Any = None
        if live:
            self._bar = _join(self.stream)
            self._task = self._bar.add_task(description, total=self.total, info="")

    @property
    def live(self) -> bool:
        return self._bar is not None

    def advance(self, n: int = 1, info: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if self._bar is not None:
            self._bar.update(self._task, advance=n, info=info)
            return
        now = time.monotonic()
        fraction = self.done / self.total
        if fraction >= self._next_tenth or self.done == self.total or now - self._last_line >= PLAIN_EVERY_S:
            self._next_tenth = (int(fraction * 10) + 1) / 10
            self._last_line = now
            self.line(f"{self.done}/{self.total}" + (f" {info}" if info else ""))

    def line(self, text: str) -> None:
        """One plain line about this step: `HH:MM:SS description: text (elapsed, left)`."""
        elapsed = time.monotonic() - self._t0
        left = ""
        if 0 < self.done < self.total:
            left = f", ~{_fmt_s(elapsed / self.done * (self.total - self.done))} left"
        out = f"{time.strftime('%H:%M:%S')} {self.description}: {text} ({_fmt_s(elapsed)}{left})"
        if self._bar is not None:
            self._bar.console.print(out, markup=False, highlight=False)
        else:
            print(out, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.remove_task(self._task)
            self._bar = None
            _leave()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _join(stream: TextIO) -> Any:
    """The shared rich display, started on first use."""
    global _shared, _users
    with _lock:
        if _shared is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            _shared = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=True,
                               console=Console(file=stream))
            _shared.start()
        _users += 1
        return _shared


def _leave() -> None:
    global _shared, _users
    with _lock:
        _users -= 1
        if _users == 0 and _shared is not None:
            _shared.stop()
            _shared = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def quiet_library_bars(stream: TextIO | None = None) -> None:
    """Off a terminal, turn off the bars the libraries underneath draw (transformers' "Loading weights" and
    "Writing model shards", datasets' "Map", the hub's downloads): in a log they are fragments joined by
    carriage returns. On a terminal they are left as they are. Process-wide, as those libraries' switches are."""
    if _isatty(stream if stream is not None else sys.stderr):
        return
    with suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    with suppress(ImportError):
        import datasets

        datasets.disable_progress_bars()
    with suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


@contextmanager
def progress(total: int, description: str) -> Iterator[StepProgress]:
    bar = StepProgress(total, description)
    try:
        yield bar
    finally:
        bar.close()


__all__ = ["PLAIN_EVERY_S", "StepProgress", "hold_terminal", "progress", "quiet_library_bars"]
