"""Every default threshold of the analyses, in one place (units in the names: shares are fractions).

Change a default here and every analysis, the report and the command line follow.
"""
from __future__ import annotations

SINK_EPS = 0.3  # alpha_k > eps makes (sample, layer, head) a sink (Gu et al. 2025)
SINK_K_MAX = 16  # alpha kept for keys 1..min(T, SINK_K_MAX)
SINK_HEAD_MIN_SHARE = 0.5  # a sink head sinks on at least this fraction of samples
SINK_MIN_ALPHA = 0.3  # a sink (KV) head has mean alpha_1 above this (key manifold, value norms)

SPIKE_ABS = 100.0  # massive activation: |a| > SPIKE_ABS ... (Sun et al. 2024)
SPIKE_RATIO = 1000.0  # ... and |a| >= SPIKE_RATIO x the median |a| of its hidden state
# Sun et al.'s absolute floor (|a| > 100) presumes a model of LLM width; a model narrower than NARROW_MODEL_D (the
# reference models trained here: d 64) has no activation near 100 however massive, so its criterion is relative only:
# |a| >= SPIKE_RATIO_NARROW x the median |a| of its hidden state (``analysis.chain.massive.spike_criterion``).
NARROW_MODEL_D = 256
SPIKE_RATIO_NARROW = 50.0
SPIKE_MIN_SHARE = 0.5  # a spike dimension is flagged on at least this fraction of samples
SPIKE_SAMPLES = 32  # sequences used to find spike dimensions when an analysis needs them

TINY = 1e-30  # floor of denominators

# The residual stream a profile pass keeps for later passes to resume from (passes.checkpoint_layers): every s-th block
# that fits. 96 MiB keeps every 2nd block of SmolLM2 at N = 32, T = 64 (66 MiB): a pass then starts at most one block
# before the one it changes, and the report's peak memory stays near 1.2x a forward pass (1.30x with every block kept).
RESID_BUDGET_MIB = 96.0

# Sinks at any position (analysis.positions.every_sink): alpha_k over fewer queries than this is those queries' local
# attention (the last key's alpha is the last query's attention on itself), not a sink, so keys seen by fewer than
# min(SINK_MIN_QUERIES, T // 2) queries are left out of the sink table.
SINK_MIN_QUERIES = 16
# A later token is aligned with the first token at a layer when the cosine of their hidden states (hook_resid_post)
# exceeds this (secondary sinks, arXiv 2512.22213: the layer where it is created and how many layers it lasts).
SECONDARY_COS = 0.9
# Where the spike comes from (analysis.chain.spike_writers): a block writes the spike when its write on the first token is at
# least SPIKE_WRITE_SHARE of the value it leads to (erases it: of the value it removes), and at least Sun et al.'s
# absolute threshold and SPIKE_WRITE_FLOOR of the spike's peak.
SPIKE_WRITE_SHARE = 0.1
SPIKE_WRITE_FLOOR = 1e-3
NEURON_SHARES = (0.9, 0.99)  # the fewest neurons carrying these shares of an MLP's write on the spike dim
# The follow-ups of the spike's origin in a profile (``analysis.profile(..., analyses=(..., "cause", "cuts"))``): why
# the first token, and the causal cuts of the writer neurons (one pass each), run on this many main-kind sequences.
SPIKE_CUT_SAMPLES = 8
RANK_ONE_ENERGY = 0.5  # "rank one": A_d's top eigenvalue holds at least this share of sum(lambda^2) ...
RANK_ONE_COS = 0.5  # ... and the first token's MLP input lies along its eigenvector (mean |cos| at least this)
# What a sink does for its head (analysis.causal.dormant_heads): a query is quiet (inert) for a head when its output norm
# (|loss effect|) lies below this quantile of the head's; heads sinking on at least DORMANT_MIN_SHARE of their queries
# enter the pooled correlations, heads with at least DORMANT_MIN_QUERIES sinking and other queries the pooled shares.
DORMANT_QUANTILE = 0.5
DORMANT_MIN_SHARE = 0.05
DORMANT_MIN_QUERIES = 20
DORMANT_GRAD_BATCH_TOKENS = 256  # tokens per forward + backward batch (the backward keeps that batch's activations)

# Repeated tokens (analysis.positions.repeated_tokens): a hidden-state deviation across positions (relative to the
# first position's largest |h|) or a gap to a proposition's closed form (in attention weight) below this counts as
# "holds" in the findings; the tables give the measured numbers.
REPEATED_TOL = 1e-4
