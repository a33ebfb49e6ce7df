"""Device memory: ``probe.py`` (readings), ``plan.py`` (the boot plan: reserve, weights, workspace, KV pages vs
expert slots), ``concurrency.py`` (the default max running requests: what the plan carries), ``guard.py`` (the OOM recovery ladder at the engine's step boundary). Nothing here runs a forward
pass: the engine warms up and runs steps, this room measures and decides."""
