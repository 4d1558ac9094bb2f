"""tag-scheduler service: resources, capability tags, roles and liveness."""
