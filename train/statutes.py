"""Parse the statute Markdown files (`gesetze/*.md`) into sections.

Layout (bundestag/gesetze): YAML front matter, one `#` heading with the law's name, structural
headings (`## Buch 1 - …`, `### Abschnitt 1 - …`) and one heading per section
(`###### § 433 Vertragstypische Pflichten beim Kaufvertrag`, `### Art 1`, `###### Art 3 - Titel`);
the heading depth varies with the law's structure, so a section is recognised by its `§`/`Art`
label, not by its depth. Grouped repealed ranges (`(XXXX) §§ 3 bis 6 (weggefallen)`) and annexes
(`Anlage …`) are not sections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

from lorafleet.core.settings import DataDirError

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
# "§ 433 Title", "§ 31a Title", "§ 86" (no title), "Art 3 - Title", "Art 1".
_SECTION = re.compile(r"^(§|Art\.?)\s+(\d+[a-z]?)\b\s*(?:-\s*)?(.*)$")
_FOOTNOTE_DEF = re.compile(r"^\[\^[^\]]+\]:")
_FOOTNOTE_REF = re.compile(r"\[\^[^\]]+\]")
_REPEALED = "(weggefallen)"


@dataclass(frozen=True)
class Section:
    """One section (§ or Art.) of a law, with whitespace-normalised text."""

    law: str  # file stem, e.g. "bgb"
    kind: str  # "§" or "Art."
    number: str  # "433", "31a"
    title: str  # may be empty (e.g. GG articles carry no heading)
    text: str
    path: tuple[str, ...] = field(default=())  # enclosing Buch/Abschnitt/Titel headings, outermost first

    @property
    def id(self) -> str:
        return f"{self.law}:{self.kind}{self.number}"

    @property
    def label(self) -> str:
        return f"{self.kind} {self.number}"


@dataclass(frozen=True)
class Law:
    stem: str
    name: str  # the law's full name from its `#` heading
    abbreviation: str  # `jurabk` from the front matter, e.g. "BGB"
    sections: tuple[Section, ...]


def statutes_dir(data_dir: Path) -> Path:
    folder = Path(data_dir) / "gesetze"
    if not folder.is_dir():
        raise DataDirError(
            f"{folder} does not exist: LORAFLEET_DATA_DIR must hold a gesetze/ folder with the statutes' *.md files"
        )
    return folder


def available_laws(data_dir: Path) -> list[str]:
    return sorted(p.stem for p in statutes_dir(data_dir).glob("*.md"))


def law_path(data_dir: Path, stem: str) -> Path:
    path = statutes_dir(data_dir) / f"{stem}.md"
    if not path.is_file():
        raise DataDirError(f"unknown law {stem!r}; available: {', '.join(available_laws(data_dir))}")
    return path


def normalise(text: str) -> str:
    return " ".join(text.replace("**", "").split())


def _front_matter(lines: list[str]) -> tuple[dict[str, str], int]:
    if not lines or lines[0].strip() != "---":
        return {}, 0
    meta: dict[str, str] = {}
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            return meta, i + 1
        key, sep, value = lines[i].partition(":")
        if sep:
            meta[key.strip()] = value.strip()
    return meta, 0


def _body_text(lines: list[str]) -> str:
    """A section's body: footnote references and definitions (with their indented lines) removed."""
    kept: list[str] = []
    in_footnote = False
    for line in lines:
        if _FOOTNOTE_DEF.match(line):
            in_footnote = True
            continue
        if in_footnote and (line.startswith("    ") or not line.strip()):
            continue
        in_footnote = False
        kept.append(_FOOTNOTE_REF.sub("", line))
    return normalise("\n".join(kept))


def parse_law_text(stem: str, raw: str) -> Law:
    lines = raw.splitlines()
    meta, start = _front_matter(lines)
    name = meta.get("Title", stem)
    sections: list[Section] = []
    stack: list[tuple[int, str]] = []  # open structural headings: (depth, text)
    current: tuple[int, re.Match[str]] | None = None
    body: list[str] = []

    def flush() -> None:
        if current is None:
            return
        depth, m = current
        kind = "§" if m.group(1) == "§" else "Art."
        title = normalise(m.group(3))
        text = _body_text(body)
        if _REPEALED in title or not text or text == _REPEALED:
            return
        path = tuple(t for d, t in stack if d < depth)
        sections.append(Section(stem, kind, m.group(2), title, text, path))

    for line in lines[start:]:
        h = _HEADING.match(line)
        if h is None:
            if current is not None:
                body.append(line)
            continue
        flush()
        current, body = None, []
        depth, heading = len(h.group(1)), h.group(2)
        if depth == 1:
            name = heading
            continue
        m = _SECTION.match(heading)
        if m is not None:
            current = (depth, m)
            continue
        # A structural heading: it closes every open heading at its depth or deeper.
        stack = [(d, t) for d, t in stack if d < depth]
        stack.append((depth, normalise(heading.replace(" - ", " "))))
    flush()
    return Law(stem=stem, name=name, abbreviation=meta.get("jurabk", stem.upper()), sections=tuple(sections))


def parse_law(data_dir: Path, stem: str) -> Law:
    path = law_path(data_dir, stem)
    return parse_law_text(stem, path.read_text(encoding="utf-8"))


def _unique_laws(laws: list[str]) -> list[str]:
    if len(set(laws)) != len(laws):
        raise ValueError(f"laws must be unique, got {laws}")
    return laws


# The `data.laws` of every kind's statute data: file stems under LORAFLEET_DATA_DIR/gesetze, each once.
LawStems = Annotated[list[str], AfterValidator(_unique_laws)]
