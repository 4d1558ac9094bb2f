"""The settings of gateway processes sharing sessions: ``SF_GATEWAY_REUSE_PORT`` needs a
fixed ``SF_GATEWAY_PORT``. Several gateways serving the same sessions are
tests/mesh/test_gateway_shared.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sf_gateway.settings import GatewaySettings


def test_reuse_port_needs_a_fixed_port() -> None:
    with pytest.raises(ValidationError, match="fixed SF_GATEWAY_PORT"):
        GatewaySettings(port=0, reuse_port=True)
