"""The host side of a train batch, in NumPy: forecasting examples, segments cut to the row,
per-term weights, packing into [micro, rows, L] (driven by batching). Nothing here runs on a device:
`PackedBatch` is the pytree of NumPy arrays the train step places on the mesh."""
