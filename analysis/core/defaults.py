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
# The sink's kind (analysis.causal.sink_kind): a sink head is nop, broadcast or mixed by these thresholds, chosen on
# the ground-truth reference models nop-task-s0..s2 and broadcast-task-s0..s2 (docs/training.md), never on a pretrained
# model: each lies between the two kinds' ranges measured there (see docs/analyses/sink-kind.md).
KIND_VALUE_RATIO = 1.0  # |v_1| / mean |v_j|: a nop's first value below, a broadcast's above
KIND_OUT_RATIO = 1.0  # the head's mean output norm on sinking queries over the rest: a nop's below, a broadcast's above
KIND_BROADCAST_PR = 1.3  # a broadcast's outputs over sinking queries in one sequence: participation ratio below this
KIND_BROADCAST_COS = 0.9  # ... and a mean cosine to their mean direction above this
KIND_MIN_QUERIES = 4  # sinking queries a sequence needs for its participation ratio and cosine

# Repeated tokens (analysis.positions.repeated_tokens): a hidden-state deviation across positions (relative to the
# first position's largest |h|) or a gap to a proposition's closed form (in attention weight) below this counts as
# "holds" in the findings; the tables give the measured numbers.
REPEATED_TOL = 1e-4

# ---------- Moved here from the modules that read them (#38: one owner per fact); each module still exposes its old name.

# Interventions (analysis.causal.conditions, read by interventions and writer_cuts; the module name is K_MAX): alpha is
# kept for keys 1..INTERVENTION_K_MAX in every intervention pass.
INTERVENTION_K_MAX = 4
# The writer neurons' causal cut (analysis.causal.writer_cuts, module name N_RANDOM): random-neuron draws per condition,
# the cut's control.
WRITER_CUT_RANDOM_DRAWS = 3
# What a sink does for its head (analysis.causal.dormant_result): a layer's heads go dormant with the sink when the
# median rho of sink attention with output norm is at most this.
DORMANT_LAYER_RHO = -0.3

# Why the first token (analysis.chain.first_token_cause, module names MAX_NEURONS and DIVERGED): writer neurons followed
# per block (the largest first), and a write "differs" between the two positions when
# |first - later| / (|first| + |later|) is at least FIRST_TOKEN_DIVERGED.
FIRST_TOKEN_MAX_NEURONS = 8
FIRST_TOKEN_DIVERGED = 0.3

# The first key's manifold (analysis.chain.key_manifold, module names DEFAULT_N_COMPONENTS, VARIANCE_LEVEL, SAME_POINT):
# the other keys' principal subspace explains this share of their variance (or is an int number of components), the
# first_n90 / other_n90 columns count the components for KEY_VARIANCE_LEVEL of the variance, and keys whose variance is
# below KEY_SAME_POINT of their squared norm count as one point.
KEY_MANIFOLD_N_COMPONENTS = 0.9
KEY_VARIANCE_LEVEL = 0.9
KEY_SAME_POINT = 1e-6

# Query-key angles (analysis.chain.qk, module name N_BINS): fixed bins of the cosine histograms on [-1, 1].
QK_COS_BINS = 40

# Sinks against context length (analysis.positions.context_length, module name EPS_GRID): the thresholds each run
# measures, and Barbero et al.'s (2025) eps, the second curve of the figure and the findings.
CONTEXT_EPS_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
BARBERO_EPS = 0.8

# The mechanism chain of a small model (analysis.dynamics.compare.mechanism_chain): a massive activation is at least
# SPIKE_RATIO_SMALL x the median (no absolute floor).
SPIKE_RATIO_SMALL = 100.0

# Formation over training (analysis.dynamics.formation).
# The final model's spike dims: at least 20x the first token's median |activation| entering the sink layer on most
# samples. A 64-wide vector at initialisation has its largest |a| at 4-5x its median; the induction runs' spike sits
# at 40-100x, and Sun et al.'s 1000x (and 100 absolute) is out of reach of a 64-wide model.
SPIKE_RATIO_FOLLOW = 20.0
# A cut's kept share of Sink_1 is defined where Sink_1 is at least this (a share of a smaller sink is noise).
CUT_MIN_SINK_PCT = 5.0
N_RANDOM_CUT = 1  # random-neuron draws per snapshot in the writer cut (its control)
# The writer of the main dim is named where its first-token |value| entering the sink layer is at least the first
# token's median |a| there (smaller, the "write share" of a value no larger than a typical activation is noise).
WRITER_MIN_RATIO = 1.0
# Onset criteria, one per link (analysis.dynamics.formation.ONSETS). A link has formed at the first snapshot where it
# meets its criterion.
SINK_ONSET_PCT = 10.0  # Sink_1 >= 10%: a tenth of (sample, layer, head) triples sink (the final models: about 40%)
SPIKE_ONSET_RATIO = 10.0  # the followed dims reach 10x the first token's median |a| (initialisation: 3-5x)
WRITER_ONSET_SHARE = 0.5  # one MLP writes at least half the value the sink layer reads on the main spike dim
WRITER_ONSET_NEURONS = 4  # at most 4 neurons (of d_mlp) carry 90% of that MLP's write
NORM_ONSET_SHARE = 0.5  # the spike dims hold half the first token's |x|^2 after norm and gain (chance: n_dims / d)
KEY_ONSET_Z = 1.5  # k_1 lies 1.5x as far off the other keys' principal subspace as a typical key (init 0.8-1.2)
COS_ONSET = 0.3  # queries meet k_1 at a mean cosine of at least 0.3 (initialisation: about 0)
VALUE_ONSET_RATIO = 0.5  # |v_1| at most half the mean |v_j| (initialisation: about 1)
CUT_ONSET_KEPT = 0.5  # a cut on the first token keeps at most half of Sink_1
HALF_WAY = 0.5  # the half-way onset: the first step where a link has moved half-way from its first to its final value

# The report's cheap range of context lengths for its sink-against-T section (longer ones: scripts/sink_context.py).
REPORT_CONTEXT_TS = (16, 32, 64, 128)
# The KV-cache study's sink-keeping condition: the first tokens held in full precision (StreamingLLM's and IntactKV's 4).
KV_FIRST_TOKENS = 4

# What runs a pass (analysis.engine.backends): the bridge's hook points, the Hugging Face model in its own attention,
# "auto" the latter where it gives what a pass reads; nnsight traces (analysis.model.nnsight_model). load_model's
# default is the bridge (TransformerLens' tools work on it); the command line's is "auto".
BACKENDS = ("transformer_lens", "auto", "transformers", "nnsight")
CLI_BACKEND = "auto"
