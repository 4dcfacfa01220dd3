"""The mechanism, link by link: massive activations, the first token's streamed trace (``first_token_trace``), the
blocks that write the spike (``spike_writers``), the neurons inside each MLP (``mlp_neurons``, ``quadratic_form``),
why the first token (``first_token_cause``), the norm's gain (``norm_gain``), query-key angles (``qk``), the first
key's manifold (``key_manifold``) and the sink's small values (``values``)."""
