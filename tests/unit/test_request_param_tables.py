"""The request parameter tables of chat completions and completions
(`sf_gateway.openai_api.CHAT_PARAMS` / `COMPLETION_PARAMS`), checked against the
``openai`` package's own request types, so a field a new SDK adds fails here until the
table says what the gateway does with it; and every refused or ignored parameter has a
value that exercises it (tests/support/request_params.py), which
tests/service/test_request_params.py sends to a real gateway."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types

from sf_gateway.openai_api import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    VLLM_CHAT_EXTRAS,
    VLLM_EXTRAS,
    Param,
)
from tests.support.request_params import (
    NEUTRAL_VALUES,
    NO_EFFECT_VALUES,
    REFUSED_VALUES,
    no_effect,
    refused,
)


def sdk_fields(module: Any) -> set[str]:
    """Every top-level field of an API's request, streaming or not, as the SDK types it."""
    return set(typing.get_type_hints(module.CompletionCreateParamsNonStreaming)) | set(
        typing.get_type_hints(module.CompletionCreateParamsStreaming)
    )


TABLES = [(chat_types, CHAT_PARAMS), (completion_types, COMPLETION_PARAMS)]


@pytest.mark.parametrize(("sdk", "table"), TABLES, ids=["chat", "completions"])
def test_the_table_lists_every_sdk_field_and_nothing_else(
    sdk: Any, table: dict[str, Param]
) -> None:
    fields = sdk_fields(sdk)
    assert {"model", "temperature", "stream"} <= fields  # the SDK's types were read
    assert fields - set(table) == set(), "fields of the openai SDK the gateway does not list"
    extras = set(VLLM_EXTRAS) | set(VLLM_CHAT_EXTRAS)
    assert set(table) - fields - extras == set(), "listed fields no API has"
    for name, param in table.items():
        assert param.effect in ("honoured", "no_effect", "refused") and param.why, name


@pytest.mark.parametrize("table", [CHAT_PARAMS, COMPLETION_PARAMS], ids=["chat", "completions"])
def test_every_refused_or_ignored_parameter_is_exercised(table: dict[str, Param]) -> None:
    assert set(refused(table)) <= set(REFUSED_VALUES)
    assert set(no_effect(table)) <= set(NO_EFFECT_VALUES)
    for name, value in NEUTRAL_VALUES.items():
        if name in table:
            assert table[name].neutral(value, {name: value}), name
    for name in refused(table):
        assert not table[name].neutral(REFUSED_VALUES[name], {name: REFUSED_VALUES[name]}), name
