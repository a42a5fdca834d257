"""embedfleet's control plane: the CLI, Serve YAML rendering and local cluster management."""
