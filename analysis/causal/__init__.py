"""Causal checks: the condition runner (``conditions``), ablations of the spike, the first key and the values
(``interventions``), cuts of the writer neurons (``writer_cuts``) and what a sink does for its head: the gradient x
activation pass (``dormant_heads``), its result (``dormant_result``), exact removal of a head's output
(``head_removal``) and how close the two come (``attribution``)."""
