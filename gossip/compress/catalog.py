"""What each compressor and wrapper takes: options, defaults and one-line docs, read from
their signatures and the ``Args:`` sections of their docstrings (``gossip compressors``)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from gossip.compress import build
from gossip.compress.base import COMPRESSORS


def describe() -> list[dict[str, Any]]:
    """Per registered compressor: name, doc and its options; then the wrappers' options
    (``name`` "wrappers"), which every compressor takes."""
    rows = [{"name": name, "doc": _summary(COMPRESSORS.get(name)),
             "options": _options(COMPRESSORS.get(name))} for name in COMPRESSORS.names()]
    rows.append({"name": "wrappers", "doc": "Options every compressor takes: error feedback, "
                                            "momentum correction, clipping, density warm-up.",
                 "options": _options(build, skip=("name",))})
    return rows


def _options(target, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    docs = _arg_docs(target)
    params = inspect.signature(target).parameters.values()
    return [{"option": p.name, "default": p.default, "doc": docs.get(p.name, "")}
            for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY and p.name not in skip]


def _summary(target) -> str:
    doc = (inspect.getdoc(target) or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def _arg_docs(target) -> dict[str, str]:
    """``{argument: its description on one line}`` from a Google-style ``Args:`` section."""
    doc = inspect.getdoc(target) or ""
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, re.MULTILINE)
    docs: dict[str, str] = {}
    current = None
    for line in (section.group(1) if section else "").splitlines():
        match = re.match(r"^\s{2,4}(\w+)(?: \(.*?\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and line.strip():
            docs[current] += " " + line.strip()
    return docs
