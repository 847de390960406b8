"""What a task of each capability carries besides its text (`Task.params`): generate's sampling and length
limits, score's documents. Short keys on the wire, checked by the one reader (wire_reader.py) like every body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from lorafleet.core.wire_reader import NUMBER, REQUIRED, MalformedTask, read_fields

if TYPE_CHECKING:
    from lorafleet.core.wire import Task


_GENERATE_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "mt": (int, REQUIRED), "tm": (NUMBER, 1.0), "tp": (NUMBER, 1.0), "sp": (list, None), "sd": (int, None),
    "st": (bool, False), "ch": (bool, False),
}


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """`Task.params` of a generate task (short keys on the wire, checked like every body).

    `chat`: the gateway rendered the prompt from a chat template, which already holds the special
    tokens, so the runtime adds none (what vLLM's own chat route does). `stream`: send text chunks
    while generating, not only the final result.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    chat: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"mt": self.max_tokens, "tm": self.temperature, "tp": self.top_p}
        if self.stop:
            p["sp"] = list(self.stop)
        if self.seed is not None:
            p["sd"] = self.seed
        if self.stream:
            p["st"] = True
        if self.chat:
            p["ch"] = True
        return p

    @classmethod
    def of(cls, task: Task) -> GenerateParams:
        """The parameters of a generate task; MalformedTask when they are missing or wrong."""
        if task.params is None:
            raise MalformedTask("generate task has no parameters ('p')")
        d = read_fields(task.params, "generate parameters", _GENERATE_SPEC, MalformedTask)
        stop = d["sp"] or []
        if not all(isinstance(x, str) and x for x in stop):
            raise MalformedTask("generate parameter 'sp' must be a list of non-empty strings")
        if d["mt"] < 1:
            raise MalformedTask(f"generate parameter 'mt' must be at least 1, got {d['mt']}")
        return cls(max_tokens=d["mt"], temperature=float(d["tm"]), top_p=float(d["tp"]), stop=tuple(stop),
                   seed=d["sd"], stream=d["st"], chat=d["ch"])


_SCORE_SPEC: Final[dict[str, tuple[Any, Any]]] = {"d": (list, REQUIRED)}
MAX_SCORE_DOCUMENTS: Final = 256  # per task; the gateway sends far fewer (gateway.rerank_chunk), a bound for the reader


@dataclass(frozen=True, slots=True)
class ScoreParams:
    """`Task.params` of a score task: the documents scored against the task's `text` (the query), one float
    each in `Result.scores`. One task carries a chunk of a rerank request's documents, not one pair: the
    query travels once, and the chunk's pairs are batched under the worker's token budget (`Task.tokens` is
    the chunk's padded size, pairs × longest pair)."""

    documents: tuple[str, ...]

    def to_params(self) -> dict[str, Any]:
        return {"d": list(self.documents)}

    @classmethod
    def of(cls, task: Task) -> ScoreParams:
        """The parameters of a score task; MalformedTask when they are missing or wrong."""
        if task.params is None:
            raise MalformedTask("score task has no parameters ('p')")
        docs = read_fields(task.params, "score parameters", _SCORE_SPEC, MalformedTask)["d"]
        if not docs or len(docs) > MAX_SCORE_DOCUMENTS:
            raise MalformedTask(f"score parameter 'd' must hold 1 to {MAX_SCORE_DOCUMENTS} documents, got {len(docs)}")
        if not all(isinstance(x, str) for x in docs):
            raise MalformedTask("score parameter 'd' must be a list of strings")
        return cls(tuple(docs))
