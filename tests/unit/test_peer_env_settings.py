"""The settings the environment comparison (loadtests/peer_env.py) refuses. Its TRL side
playing episodes against the real environment server is tests/mesh/test_peer_env.py."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.support import load_loadtest


@pytest.fixture(scope="module")
def peer_env() -> ModuleType:
    return load_loadtest("peer_env")


def test_the_comparison_refuses_bad_settings(peer_env: ModuleType) -> None:
    args = peer_env.parse_args(["--step-latency-ms", "0,100", "--sides", "trl"])
    assert args.step_latency_ms == [0.0, 100.0] and args.sides == ["trl"]
    for argv in (
        ["--step-latency-ms", "100,100"],
        ["--step-latency-ms", "-1"],
        ["--sides", "trl,vllm"],
        ["--group-size", "1"],
        ["--env-url", "http://127.0.0.1:1", "--step-latency-ms", "0,100"],
    ):
        with pytest.raises(SystemExit):
            peer_env.parse_args(argv)
