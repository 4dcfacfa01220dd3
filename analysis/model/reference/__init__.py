"""The reference model this package pre-trains: its config, the swappable attention operations, ``SinkLM`` (a
TransformerLens ``HookedRootModule`` with the bridge's hook names), positions, checkpoints and training data.

Low enough for the loader to import; the training loop that drives it is ``analysis.train``."""
