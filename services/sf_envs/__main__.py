"""``python -m sf_envs NAME [options]``: a built-in environment server (``sf_envs.cli``;
``seamlessflow serve env``). An HTTP server beside the mesh, not a mesh service: no
NATS, so not started through ``seamlessflow.service``."""

from sf_envs.cli import main

main()
