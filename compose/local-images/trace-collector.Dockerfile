# A stand-in for jaegertracing/jaeger in compose/docker-compose.yml, for machines where
# no image registry is reachable and so no Jaeger image can be pulled: an OTLP/HTTP
# receiver on 4318 and the parts of Jaeger's HTTP query API the compose check reads on
# 16686 (compose/local-images/trace_collector.py). It keeps spans in memory only; there
# is no UI and no OTLP/gRPC (4317). SF_JAEGER_IMAGE names the image built here.
#
# It is built on the project's own image, which already has Python and
# opentelemetry-proto. Build from the repository root, after seamlessflow:latest:
#
#   docker build -f compose/local-images/trace-collector.Dockerfile \
#     -t seamlessflow-trace-collector:local .

ARG SF_IMAGE=seamlessflow:latest
FROM ${SF_IMAGE}

COPY compose/local-images/trace_collector.py /opt/trace-collector/trace_collector.py

# The base image's user; set again so that this image never runs as root.
USER sf

EXPOSE 4318 16686

# Replaces the base image's `seamlessflow` entrypoint; arguments (e.g. --otlp-port) follow.
ENTRYPOINT ["python", "/opt/trace-collector/trace_collector.py"]
