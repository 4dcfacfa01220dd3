"""The model contract: loading (hub ids, local folders, the embedded GGUF, reference models), what each family
computes (``families``: attention; ``mlp_spec``: MLPs and experts), the TransformerLens hook names every analysis
reads (``hooks``), the one rotary implementation, the key path, the probes, and the reference model itself
(``reference``: config, attention operations, ``SinkLM``, checkpoints, training data)."""
