"""The sink itself: the metric alpha_k and Sink_k^eps (``metric``), and the output gates that can stand in for a
sink (``output_gates``)."""
