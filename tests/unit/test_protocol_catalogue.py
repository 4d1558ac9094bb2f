"""The protocol's message catalogue is one list, read from the code: every ``Message``
subclass a module of ``seamlessflow.protocol`` defines is in ``MESSAGE_TYPES``, in
``AnyMessage`` (so ``decode`` finds it by its tag without being told the type) and in
the package's interface.
"""

from __future__ import annotations

import importlib
import pkgutil
import typing

import msgspec

from seamlessflow import protocol as p
from seamlessflow.protocol import codec


def messages_defined_anywhere_in_the_package() -> set[type[p.Message]]:
    found: set[type[p.Message]] = set()
    for module_info in pkgutil.iter_modules(p.__path__, prefix=f"{p.__name__}."):
        found |= set(codec.messages_defined_in(importlib.import_module(module_info.name)))
    return found


def test_every_message_defined_in_the_package_is_catalogued() -> None:
    defined = messages_defined_anywhere_in_the_package()
    assert p.ErrorReply in defined and p.GenerateRequest in defined
    missing = sorted(message.__name__ for message in defined - set(p.MESSAGE_TYPES))
    assert missing == [], f"add the modules defining {missing} to codec.MESSAGE_MODULES"
    assert len(set(p.MESSAGE_TYPES)) == len(p.MESSAGE_TYPES)


def test_the_union_decode_uses_is_the_catalogue() -> None:
    assert typing.get_args(p.AnyMessage) == p.MESSAGE_TYPES
    tags = [message.__struct_config__.tag for message in p.MESSAGE_TYPES]
    assert len(set(tags)) == len(tags)


def test_a_message_is_decoded_without_its_type_by_its_tag() -> None:
    # messages the union once lacked: it was a second list, kept in step by hand
    for message in (
        p.ShedRequests(to_engine="engine-2", count=3),
        p.ShedReport(engine_id="engine-1", handed_over=3),
        p.GroupClosed(group_id="g1", task_id="t1", group_size=4, closed_at=1.0),
    ):
        data = p.encode(message)
        assert msgspec.json.decode(data)["type"] == type(message).__struct_config__.tag
        assert p.decode(data) == message


def test_every_message_type_is_part_of_the_packages_interface() -> None:
    for message in p.MESSAGE_TYPES:
        assert message.__name__ in p.__all__, message.__name__
        assert getattr(p, message.__name__) is message
