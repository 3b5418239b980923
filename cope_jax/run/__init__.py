"""A run's setup and its services: config, meshes and hosts, components, checkpoints, metrics,
faults, demonstrations."""
