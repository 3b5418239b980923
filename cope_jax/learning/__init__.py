"""Learning from trajectories: advantages, forecasting examples, methods and losses, packing, the train step."""
