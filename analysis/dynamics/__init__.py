"""The sink over training: the metrics the trainer logs (``metrics``), trained models side by side (``compare``),
and the order in which the links of the chain form over checkpoints (``formation``)."""
