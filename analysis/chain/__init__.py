"""The mechanism, link by link: massive activations, the MLPs and neurons that write them (``spike_writers``,
``quadratic_form``), why the first token (``first_token_cause``), the norm's gain (``norm_gain``), query-key
angles (``qk``), the first key's manifold (``key_manifold``) and the sink's small values (``values``)."""
