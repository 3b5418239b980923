"""absl binaries: python -m launch.{train,eval,convert,generate,bench}."""
