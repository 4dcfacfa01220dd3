"""The pass engine: one streamed forward pass per batch that hands each hook's activation to accumulators which
reduce it on the layer's own device (``passes``), on a backend that produces the TransformerLens-named activations
(``backends``: the bridge's hook points, or the Hugging Face model in its own attention with the fused ``kernels``),
a layer's attention as the reductions read it (``attention``: from the map or from q, k and the log-sum-exp)."""
