"""Progress of a research run: trial k of N, best so far, time left.

A live panel (rich) on a terminal; plain, greppable lines otherwise (logs, CI, tests).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from lorafleet.core.progress import hold_terminal


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    def __init__(self, study: str, n_trials: int, deadline: float, objective: str, stream: TextIO | None = None,
                 live: bool | None = None) -> None:
        self.study, self.n_trials, self.deadline, self.objective = study, n_trials, deadline, objective
        self.stream = stream or sys.stdout
        self.live_enabled = self.stream.isatty() if live is None else live
        self.best: tuple[int, float] | None = None
        self.current = ""
        self.counted = 0
        self._live: Any = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> Progress:
        if self.live_enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._render(), console=Console(file=self.stream), refresh_per_second=2,
                              transient=False)
            self._live.__enter__()
            # The trials' own step bars would redraw over this panel: they print plain lines meanwhile.
            self._hold = hold_terminal()
            self._hold.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)
            self._live = None
            self._hold.__exit__(None, None, None)

    # ---- events ---------------------------------------------------------------------------------
    def note(self, message: str) -> None:
        if self._live is not None:
            self._live.console.print(message)
        else:
            print(message, file=self.stream, flush=True)

    def trial_started(self, number: int, counted: int, params: dict[str, Any]) -> None:
        self.counted = counted
        self.current = f"trial {number} running"
        short = ", ".join(f"{k}={v}" for k, v in params.items())
        self._emit(f"[research] trial {counted}/{self.n_trials} (#{number}) started: {short}")

    def epoch(self, number: int, epoch: int, value: float) -> None:
        self.current = f"trial {number} epoch {epoch}: {self.objective}={value:.4f}"
        self._emit(f"[research] trial #{number} epoch {epoch}: {self.objective}={value:.4f}")

    def trial_finished(self, number: int, state: str, value: float | None, best: tuple[int, float] | None,
                       detail: str = "") -> None:
        self.best = best
        self.current = ""
        val = f" {self.objective}={value:.4f}" if value is not None else ""
        self._emit(f"[research] trial #{number} {state}{val}{(' (' + detail + ')') if detail else ''}")

    def _status_line(self) -> str:
        best = f"best {self.best[1]:.4f} (trial #{self.best[0]})" if self.best else "best: none yet"
        left = _fmt_s(self.deadline - time.monotonic())
        return f"{self.study}: trial {self.counted} of {self.n_trials} · {best} · {left} left"

    def _emit(self, line: str) -> None:
        if self._live is not None:
            self._live.update(self._render())
        else:
            print(f"{line} | {self._status_line()}", file=self.stream, flush=True)

    def _render(self) -> Any:
        from rich.panel import Panel
        from rich.text import Text

        body = Text(self._status_line())
        if self.current:
            body.append("\n" + self.current)
        return Panel(body, title="lorafleet research", expand=False)
