"""Who sends what to whom on each subject, declared on the method that builds the subject.

Each concrete subject builder of ``Subjects`` carries a ``Route`` (the ``@route``
decorator): the message type(s) on it, the replies if it is a request, its producers and
consumers, and how it travels. ``seamlessflow.protocol.table`` renders these as the
producer -> subject -> consumer table of docs/architecture.md; tests/unit/test_protocol_table.py
checks the table is current and each route against the code (the streams that store a
subject, the packages that use it).

Producers and consumers are named as in the service table (``gateway``, ``engine``,
``trajectory``, ``trainer``, ``weight-sync``, ``tag-scheduler``, ``agent runner``), or as
the application's readers (``embedded run``, ``seamlessflow track``, ``seamlessflow
export``); a note in parentheses says when or how, e.g. ``trajectory (on start-up)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from seamlessflow.protocol.base import Message

Transport = Literal["core", "request/reply", "JetStream"]
"""*core*: a NATS publish, lost if nobody listens; *request/reply*: one answer (or an
``ErrorReply``); *JetStream*: stored in a stream, read again after a restart."""


@dataclass(frozen=True)
class Route:
    """What travels on one subject, who produces it, who consumes it, and how."""

    sends: tuple[type[Message], ...]
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    transport: Transport
    replies: tuple[type[Message], ...] = ()
    """request/reply: the answer types (an ``ErrorReply`` may always come instead)."""
    stream: str = ""
    """JetStream: the ``Subjects`` method that names the stream storing the subject."""
    note: str = ""
    """How the messages travel when it is not as encoded messages (raw chunks...)."""

    def __post_init__(self) -> None:
        if not (self.sends and self.producers and self.consumers):
            raise ValueError("a route names its message(s), producer(s) and consumer(s)")
        if (self.transport == "JetStream") != bool(self.stream):
            raise ValueError("a JetStream route names its stream, and only it does")
        if self.replies and self.transport != "request/reply":
            raise ValueError("only a request/reply route has replies")

    @staticmethod
    def party_name(party: str) -> str:
        """``trajectory (on start-up)`` -> ``trajectory``."""
        return party.split(" (", 1)[0]


ROUTE_ATTRIBUTE = "__route__"

_Builder = TypeVar("_Builder", bound=Callable[..., str])


def route(
    sends: type[Message] | tuple[type[Message], ...],
    *,
    by: str | tuple[str, ...],
    to: str | tuple[str, ...],
    transport: Transport,
    replies: type[Message] | tuple[type[Message], ...] = (),
    stream: str = "",
    note: str = "",
) -> Callable[[_Builder], _Builder]:
    """Declare the route of the subject the decorated ``Subjects`` method builds."""
    declared = Route(
        sends=_tuple(sends),
        producers=_tuple(by),
        consumers=_tuple(to),
        transport=transport,
        replies=_tuple(replies),
        stream=stream,
        note=note,
    )

    def attach(builder: _Builder) -> _Builder:
        setattr(builder, ROUTE_ATTRIBUTE, declared)
        return builder

    return attach


def routes_of(subjects_class: type) -> dict[str, Route]:
    """Each subject builder of ``subjects_class`` with a declared route, by method name,
    in the order they are defined."""
    found = {}
    for name, member in vars(subjects_class).items():
        declared = getattr(member, ROUTE_ATTRIBUTE, None)
        if isinstance(declared, Route):
            found[name] = declared
    return found


def _tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)
