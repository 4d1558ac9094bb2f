"""The producer -> subject -> consumer table of docs/architecture.md, from the routes.

Every row is one ``@route`` of ``Subjects`` (``seamlessflow.protocol.routes``): the
subject as a pattern (``sf.<run>.engine.<policy>.generate``), built by the method itself
from placeholder arguments, so the table cannot drift from the code. The table sits in
docs/architecture.md between ``BEGIN`` and ``END``; tests/unit/test_protocol_table.py fails
when it is stale.

    python -m seamlessflow.protocol.table                                # print it
    python -m seamlessflow.protocol.table --write docs/architecture.md   # rewrite the block
    python -m seamlessflow.protocol.table --check docs/architecture.md   # exit 1 if stale
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from seamlessflow.protocol.base import Message
from seamlessflow.protocol.routes import Route, routes_of
from seamlessflow.protocol.subjects import Subjects

BEGIN = "<!-- subjects:begin -->"
END = "<!-- subjects:end -->"

# Placeholders are valid tokens (the builders check their arguments) that occur nowhere
# else in a subject, so each can be replaced by its ``<name>`` afterwards.
_RUN = "x0run"
_POLICY = "x0policy"
_INT = 987654321


class NoTableBlock(ValueError):
    """The document has no table block, or more than one."""


def _placeholder_name(parameter: str) -> str:
    return parameter.removesuffix("_id")


def subject_pattern(method: str) -> str:
    """The subject ``Subjects.<method>`` builds, with ``<run>``, ``<policy>`` and each
    argument as ``<name>`` (``session_id`` -> ``<session>``)."""
    builder = getattr(Subjects(_RUN, _POLICY), method)
    arguments: list[str | int] = []
    replacements = {_RUN: "<run>", _POLICY: "<policy>"}
    for parameter in inspect.signature(builder).parameters.values():
        shown = f"<{_placeholder_name(parameter.name)}>"
        if parameter.annotation in (int, "int"):
            arguments.append(_INT)
            replacements[str(_INT)] = shown
        else:
            value = f"x0{parameter.name}"
            arguments.append(value)
            replacements[value] = shown
    subject = str(builder(*arguments))
    for placeholder, shown in sorted(replacements.items(), key=lambda kv: -len(kv[0])):
        subject = subject.replace(placeholder, shown)
    return subject


def stream_pattern(method: str) -> str:
    """The stream ``Subjects.<method>`` names: ``SF_<RUN>_BATCH-<policy>``."""
    name = str(getattr(Subjects(_RUN, _POLICY), method)())
    return name.replace(_RUN.upper(), "<RUN>").replace(_POLICY, "<policy>")


def _names(types: tuple[type[Message], ...]) -> str:
    return ", ".join(f"`{message.__name__}`" for message in types)


def _messages(declared: Route) -> str:
    shown = _names(declared.sends)
    if declared.replies:
        shown += " -> " + _names(declared.replies)
    if declared.note:
        shown += f" ({declared.note})"
    return shown


def _travels(declared: Route) -> str:
    if declared.transport == "JetStream":
        return f"JetStream `{stream_pattern(declared.stream)}`"
    return declared.transport


def render() -> str:
    """The table block, markers included, ending with a newline."""
    lines = [
        BEGIN,
        "| producer | subject | message | consumer | travels |",
        "|---|---|---|---|---|",
    ]
    for method, declared in routes_of(Subjects).items():
        cells = (
            ", ".join(declared.producers),
            f"`{subject_pattern(method)}`",
            _messages(declared),
            ", ".join(declared.consumers),
            _travels(declared),
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def replace_block(document: str) -> str:
    """``document`` with its table block (``BEGIN`` line to ``END`` line) rendered anew."""
    if document.count(BEGIN) != 1 or document.count(END) != 1:
        raise NoTableBlock(f"the document needs exactly one {BEGIN} ... {END} block")
    start = document.index(BEGIN)
    end = document.index(END, start) + len(END)
    if document[end : end + 1] == "\n":
        end += 1
    return document[:start] + render() + document[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m seamlessflow.protocol.table",
        description="The producer -> subject -> consumer table of docs/architecture.md.",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="DOC", type=Path, help="rewrite DOC's table block")
    action.add_argument("--check", metavar="DOC", type=Path, help="exit 1 if DOC's is stale")
    options = parser.parse_args(argv)
    if options.write is None and options.check is None:
        sys.stdout.write(render())
        return 0
    path: Path = options.write or options.check
    try:
        document = path.read_text()
        current = replace_block(document)
    except (OSError, NoTableBlock) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    if options.check is not None:
        if current != document:
            print(
                f"{path}: the subjects table is stale; run {parser.prog} --write {path}",
                file=sys.stderr,
            )
            return 1
        return 0
    path.write_text(current)
    return 0


if __name__ == "__main__":
    sys.exit(main())
