"""The standard OpenTelemetry environment variables as ``telemetry.setup`` reads them,
checked as functions of an environment: the traces endpoint, the settings' OTLP endpoint,
the protocol, the service name and the resource attributes, with the precedence the
module docstring of ``seamlessflow.telemetry`` gives. A child process exporting to a real
receiver is tests/service/test_telemetry_env.py."""

from __future__ import annotations

import os

import pytest

from seamlessflow import telemetry
from seamlessflow.settings import MeshSettings


@pytest.mark.parametrize(
    ("base", "environ", "expected"),
    [
        ("", {}, ""),  # nothing configured: JSONL only
        ("http://jaeger:4318", {}, "http://jaeger:4318/v1/traces"),
        ("http://jaeger:4318/", {}, "http://jaeger:4318/v1/traces"),
        ("http://jaeger:4318/v1/traces", {}, "http://jaeger:4318/v1/traces"),
        # the signal's own variable is a full URL, used as it is, over any base URL
        (
            "http://jaeger:4318",
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:9999/ingest"},
            "http://other:9999/ingest",
        ),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}, "http://t:1/x"),
        # OTEL_SDK_DISABLED: only "true" (any case) disables, as the SDK reads it
        ("http://jaeger:4318", {"OTEL_SDK_DISABLED": "true"}, ""),
        ("http://jaeger:4318", {"OTEL_SDK_DISABLED": " TRUE "}, ""),
        (
            "",
            {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"},
            "",
        ),
        ("http://jaeger:4318", {"OTEL_SDK_DISABLED": "false"}, "http://jaeger:4318/v1/traces"),
    ],
)
def test_the_traces_endpoint_follows_the_otel_precedence(
    base: str, environ: dict[str, str], expected: str
) -> None:
    assert telemetry.traces_endpoint(base, environ) == expected


def test_the_settings_read_sf_otlp_endpoint_before_the_otel_base_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in os.environ if n.startswith(("SF_", "OTEL_"))]:
        monkeypatch.delenv(name)
    assert MeshSettings().otlp_endpoint == ""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert MeshSettings().otlp_endpoint == "http://collector:4318"
    monkeypatch.setenv("SF_OTLP_ENDPOINT", "http://mine:4318")
    assert MeshSettings().otlp_endpoint == "http://mine:4318"


def test_only_otlp_over_http_with_protobuf_is_accepted() -> None:
    telemetry.check_protocol({})
    telemetry.check_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        for protocol in ("grpc", "http/json"):
            with pytest.raises(ValueError, match=f"{name}={protocol}: .*http/protobuf"):
                telemetry.check_protocol({name: protocol})
    # the signal's own variable wins over the generic one, both ways
    telemetry.check_protocol(
        {
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        }
    )
    with pytest.raises(ValueError, match="TRACES_PROTOCOL=grpc"):
        telemetry.check_protocol(
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            }
        )


def clear_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)


def test_the_service_name_is_a_default_that_otel_service_name_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clear_otel(monkeypatch)

    def name() -> object:
        return telemetry.service_resource("engine", "run-1").attributes["service.name"]

    assert name() == "engine"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes")
    assert name() == "from-attributes"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sf-engine-gpu")
    assert name() == "sf-engine-gpu"  # over both, as the OTel specification says


def test_resource_attributes_are_merged_and_the_run_id_is_the_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clear_otel(monkeypatch)
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "deployment.environment=staging, team=rl%2Finfra,sf.run_id=stale-run",
    )
    attributes = telemetry.service_resource("trainer", "run-7").attributes
    assert attributes["deployment.environment"] == "staging"
    assert attributes["team"] == "rl/infra"  # values are URL-decoded
    assert attributes["sf.run_id"] == "run-7"
    assert attributes["service.name"] == "trainer"
    assert attributes["telemetry.sdk.name"] == "opentelemetry"  # the SDK's own stay
    # without a run id the variable's value stands
    assert telemetry.service_resource("trainer").attributes["sf.run_id"] == "stale-run"
