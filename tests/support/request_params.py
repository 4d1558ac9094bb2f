"""Values for the request parameters of the gateway's tables
(``sf_gateway.openai_api.CHAT_PARAMS`` / ``COMPLETION_PARAMS``): for each refused
parameter a value it cannot take and (where it has one) its neutral value, a value for
each parameter without effect, and a table's refused and no-effect names.
tests/unit/test_request_param_tables.py checks that every such parameter has its value;
tests/service/test_request_params.py sends them to a real gateway."""

from __future__ import annotations

from typing import Any

from sf_gateway.openai_api import Param

# A value each refused parameter cannot take (not null, not its neutral value).
# tests/unit/test_request_param_tables.py fails for a refused parameter without one, so
# each gets a request.
REFUSED_VALUES: dict[str, Any] = {
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "logit_bias": {"5": 10},
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "guided_json": {"type": "object"},
    "guided_regex": "[0-9]+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"json": {"type": "object"}},
    "parallel_tool_calls": False,
    "functions": [{"name": "add", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "moderation": {"policy": {"input": {"mode": "block"}}},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "chat_template_kwargs": {"enable_thinking": False},
    "echo": True,
    "suffix": " the end",
    "best_of": 3,
}


# The neutral value of each refused parameter: asks for what the gateway does anyway.
NEUTRAL_VALUES: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {"5": 0},
    "min_p": 0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "parallel_tool_calls": True,
    "modalities": ["text"],
    "chat_template_kwargs": {},
    "echo": False,
    "suffix": "",
    "best_of": 1,
}


NO_EFFECT_VALUES: dict[str, Any] = {
    "user": "agent-7",
    "metadata": {"run": "x"},
    "store": False,
    "service_tier": "auto",
    "safety_identifier": "u-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {},
    "prediction": {"type": "content", "content": "4"},
}


def refused(table: dict[str, Param]) -> list[str]:
    return sorted(name for name, param in table.items() if param.effect == "refused")


def no_effect(table: dict[str, Param]) -> list[str]:
    return sorted(name for name, param in table.items() if param.effect == "no_effect")
