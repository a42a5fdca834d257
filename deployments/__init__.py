"""embedfleet's Ray Serve application: config schema, router, engine replicas and their contracts."""
