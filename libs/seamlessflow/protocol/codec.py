"""Encoding and decoding, and the catalogue of every message type.

``MESSAGE_TYPES`` is read from the domain modules, not listed: every ``Message``
subclass a module of ``MESSAGE_MODULES`` defines is in it, in definition order, so a new
message joins the catalogue (and ``decode``'s union) by being defined.
tests/unit/test_protocol_catalogue.py fails when a module of this package defines a
message and is missing from ``MESSAGE_MODULES``.

``AnyMessage`` is the tagged union of the catalogue, what ``decode`` uses when no type is
expected; a decoder per expected type is built once and kept.
"""

from __future__ import annotations

import functools
import operator
from types import ModuleType
from typing import Any

import msgspec

from seamlessflow.protocol import (
    base,
    batches,
    engine,
    scheduler,
    tasks,
    trainer,
    trajectory,
    weights,
)
from seamlessflow.protocol.base import SCHEMA_VERSION, Message, ProtocolError

MESSAGE_MODULES: tuple[ModuleType, ...] = (
    base,
    engine,
    trajectory,
    tasks,
    batches,
    weights,
    trainer,
    scheduler,
)
"""The modules that define messages (the domains of ``seamlessflow.protocol``)."""


def messages_defined_in(module: ModuleType) -> list[type[Message]]:
    """The ``Message`` subclasses ``module`` defines (not those it imports), in the order
    it defines them."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, Message)
        and value is not Message
        and value.__module__ == module.__name__
    ]


MESSAGE_TYPES: tuple[type[Message], ...] = tuple(
    message for module in MESSAGE_MODULES for message in messages_defined_in(module)
)
"""Every message type on the wire, ``ErrorReply`` first."""

AnyMessage: Any = functools.reduce(operator.or_, MESSAGE_TYPES)
"""The union of ``MESSAGE_TYPES``, told apart by their type tags (``Message.type``)."""

_encoder = msgspec.json.Encoder()
_any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, expected: Any = None) -> Any:
    """Decode a wire payload; ``expected`` is a Message class or a union of them.

    Raises ``ProtocolError`` for anything that is not a valid message of the expected
    type(s) or that carries a newer schema than this build understands.
    """
    try:
        if expected is None:
            message = _any_decoder.decode(data)
        else:
            message = _decoder_for(expected).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    if message.schema > SCHEMA_VERSION:
        raise ProtocolError(
            f"message schema {message.schema} is newer than supported {SCHEMA_VERSION}"
        )
    return message


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder_for(expected: Any) -> msgspec.json.Decoder[Any]:
    decoder = _decoders.get(expected)
    if decoder is None:
        decoder = _decoders[expected] = msgspec.json.Decoder(expected)
    return decoder
