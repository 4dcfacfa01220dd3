"""The pass engine: one streamed forward pass per batch that hands each hook's activation to accumulators which
reduce it on the layer's own device (``passes``), and the fused sink path that reads alpha inside the attention
kernel (``fused_sink``)."""
