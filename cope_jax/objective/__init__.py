"""What is optimized, as pure functions on arrays: the advantage estimators, the losses and the
registry of loss terms and methods. Read by both sides: the host's batch preparation and the
device's train step."""
