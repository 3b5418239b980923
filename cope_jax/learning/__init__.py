"""Learning from trajectories: advantages, forecasting examples, methods and losses, segments,
weights and packing, the train step."""
