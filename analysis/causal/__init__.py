"""Causal checks: the condition runner (``conditions``), ablations of the spike, the first key and the values
(``interventions``), cuts of the writer neurons (``writer_cuts``) and what a sink does for its head
(``dormant_heads``)."""
