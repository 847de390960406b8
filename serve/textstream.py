"""One streamed answer at the gateway: worker chunks in, client events out, never duplicated, never cut silently.

A worker sends numbered chunks (`Result.seq`) tagged with the task's delivery (`Result.attempt`),
then the final result with the whole text. What reaches the client is tracked as `emitted`:

- Chunks of the current delivery extend the text in order; a missing sequence number (a chunk lost
  while the gateway reconnected) stops the chunk path for that delivery, and the final result, which
  carries the whole text, fills in the rest. A worker publishes a task's chunks in order, check-ins
  included (sidecar/streaming.py), and core NATS keeps one connection's order, so a chunk out of
  turn means one was lost, never that one overtook another.
- A worker that dies mid-stream leaves its task unacked; JetStream delivers it again and the new
  worker starts from the beginning. Its text is compared with what the client already has: while it
  repeats that prefix nothing is sent, past it only the new part is. With greedy or seeded decoding
  the restart reproduces the prefix and the client sees one seamless answer. A restart that differs
  from what was sent (sampling without a seed) ends the stream with an explicit error event.
- Chunks of an older delivery are dropped once a newer one has begun.

Pure logic on one event loop: events go to an asyncio queue that the SSE writer reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from lorafleet.core.wire import Result

DIVERGED = ("stream_interrupted",
            "the worker generating this answer stopped, and generating it again gave a different text than the "
            "part already sent; the answer ends here (with temperature 0 or a seed a restart resumes seamlessly)")


@dataclass(frozen=True, slots=True)
class Event:
    kind: Literal["delta", "final", "error"]
    text: str = ""
    result: Result | None = None  # final: usage and finish reason
    code: str = ""  # error
    message: str = ""


class TextStream:
    def __init__(self) -> None:
        self.emitted = ""
        self.attempt = 0
        self.attempt_text = ""
        self.next_seq = 0
        self.gap = False
        self.done = False
        self.events: asyncio.Queue[Event] = asyncio.Queue()

    def chunk(self, r: Result) -> None:
        if self.done or r.attempt < self.attempt or r.seq is None:
            return
        if r.attempt > self.attempt:  # a new delivery starts from the beginning
            self.attempt, self.attempt_text, self.next_seq, self.gap = r.attempt, "", 0, False
        if self.gap:
            return
        if r.seq != self.next_seq:
            self.gap = True  # a chunk went missing: the final result carries the whole text
            return
        self.next_seq += 1
        self.attempt_text += r.text or ""
        self._advance(self.attempt_text, final=False)

    def final(self, r: Result) -> None:
        if self.done:
            return
        if self._advance(r.text or "", final=True):
            self.done = True
            self.events.put_nowait(Event("final", result=r))

    def fail(self, code: str, message: str) -> None:
        if not self.done:
            self.done = True
            self.events.put_nowait(Event("error", code=code, message=message))

    def _advance(self, text: str, final: bool) -> bool:
        """Send what `text` adds to what the client has; False (and an error event) when they disagree."""
        if text.startswith(self.emitted):
            if len(text) > len(self.emitted):
                self.events.put_nowait(Event("delta", text=text[len(self.emitted):]))
                self.emitted = text
            return True
        if not final and self.emitted.startswith(text):
            return True  # a restart still repeating what was sent
        self.fail(*DIVERGED)
        return False
