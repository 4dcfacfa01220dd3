"""Sink-aware generation: StreamingLLM's cache (the first ``sinks`` tokens and the most recent ``window - sinks``),
optionally with a quantised window and full-precision sinks, as a cache ``model.generate`` takes.

    from analysis import load_model, sink_cache
    from analysis.streaming.backbone import causal_lm
    model = load_model("smollm2-135m")
    ids = model.tokenizer("The attention sink", return_tensors="pt").input_ids
    with causal_lm(model) as hf:                 # the model's own Hugging Face module, in its own attention
        out = hf.generate(ids, cache=sink_cache(hf, window=256, sinks=4), max_new_tokens=2048, do_sample=False)

``sink_cache`` takes the Hugging Face causal LM that generates (that one, or any ``AutoModelForCausalLM``): it
builds a cache for transformers' ``generate``, it is not an analysis of a loaded model.

It is :class:`analysis.streaming.cache.StreamingCache`, the cache the streaming perplexity decodes with: generate
numbers the tokens 0, 1, 2, ... (its ``position_ids``), which is how that cache takes them (keys at their true
distance from the query, the sinks re-rotated forward by the evictions, so every kept key sits where StreamingLLM puts
it). Each layer's rotary frequencies come from ``analysis.model.families.decoder_positions``. A prompt longer than the
window needs ``prefill_chunk_size=1`` (StreamingLLM feeds it a token at a time); a left-padded batch is not supported
(the pad tokens would be the sinks). The quantisation is simulated (stored de-quantised, as the perplexity study does).
"""

from __future__ import annotations

from analysis.model.causal import context_length
from analysis.model.contract import is_model, runs_bridge_components
from analysis.model.families import decoder_positions
from analysis.streaming.cache import Policy, RopeSpec, StreamingCache

# Rope types whose frequencies change with the sequence length: a kept key cannot be moved by a fixed rotation.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
POSITION_WORDS = {
    "alibi": "ALiBi position biases",
    "absolute": "learned absolute positions",
    "relative": "relative position buckets",
}


NO_CACHE = (
    "runs TransformerLens' attention, which keeps no KV cache (generate would ignore the cache): build the cache "
    "for, and generate with, the model's own causal LM: `with analysis.streaming.backbone.causal_lm(model) as "
    "hf: hf.generate(ids, cache=sink_cache(hf, ...))`."
)


def _check_lm(hf) -> None:
    if is_model(hf):
        raise ValueError("a model analysis.load_model returns " + NO_CACHE)
    if not hasattr(hf, "generate") or not hasattr(hf, "config"):
        raise TypeError(f"sink_cache takes a transformers causal LM; got {type(hf).__name__}.")
    if runs_bridge_components(hf):
        raise ValueError("this Hugging Face module (a bridge's hf_module) " + NO_CACHE)


def _refusal(pos, window: int, n_ctx: int | None) -> str | None:
    """Why this model cannot generate with a sink cache of ``window`` tokens (one line, what to do), or None."""
    fam = pos.family
    if pos.other_layers:
        kinds = sorted({w.split(":")[0] for w in pos.other_layers.values()})
        return (
            f"{fam} has {', '.join(kinds)} layers ({sorted(pos.other_layers)}): a sink cache holds attention keys "
            "only; use a model whose layers are all softmax attention."
        )
    if pos.positions in POSITION_WORDS:
        return (
            f"{fam} uses {POSITION_WORDS[pos.positions]}, which a sink cache cannot move to the kept tokens' "
            "positions; use a rotary family (Llama, Mistral, Qwen, Gemma, Phi, SmolLM...)."
        )
    if pos.latent:
        return f"{fam} uses multi-head latent attention, whose shared rotary key a sink cache does not re-rotate."
    if pos.rope_type in LENGTH_DEPENDENT_ROPE:
        return (
            f"{fam}'s {pos.rope_type} rotary changes its frequencies with the length, so kept keys cannot be "
            "moved by a fixed rotation; load the model with its default rope type."
        )
    if n_ctx is not None and window > n_ctx:
        return f"window={window} exceeds the model's context ({n_ctx} tokens): use window <= {n_ctx}."
    if pos.sliding_window is not None and window > pos.sliding_window:
        return (
            f"window={window} exceeds {fam}'s sliding window ({pos.sliding_window}), which would hide the sinks "
            f"from its sliding layers: use window <= {pos.sliding_window}."
        )
    if pos.chunk is not None and window >= pos.chunk:
        return f"window={window} reaches {fam}'s attention chunk ({pos.chunk}): use window < {pos.chunk}."
    return None


def sink_cache(hf, *, window: int, sinks: int = 4, bits: int | None = None, fp_sinks: bool = True) -> StreamingCache:
    """A fresh StreamingLLM cache for one ``model.generate(..., cache=...)`` call: it keeps the first ``sinks``
    tokens and the most recent ``window - sinks`` (``window`` per layer in all), re-rotating the sinks' keys as the
    window moves. Bad settings are refused here, before any work.

    Parameters
    ----------
    hf : transformers.PreTrainedModel
        The causal LM that generates (``AutoModelForCausalLM``; for a model ``analysis.load_model`` returns, its own
        module inside ``with analysis.streaming.backbone.causal_lm(model) as hf:``: the bridge keeps no KV cache).
    window : int
        Tokens kept per layer, sinks included (StreamingLLM's s + w); at most the model's context and sliding window.
    sinks : int
        The first tokens kept (0: a plain sliding window, the baseline StreamingLLM beats).
    bits : {8, 4, 3, 2} or None
        Simulated KV quantisation of the window (per token and head, min-max); None: full precision.
    fp_sinks : bool
        With ``bits``: keep the sinks in full precision (as IntactKV does).

    Returns
    -------
    StreamingCache
        Pass it as ``cache=`` (transformers 5; ``past_key_values=`` is its deprecated name). Without padding; a
        prompt longer than ``window`` needs ``prefill_chunk_size=1``.
    """
    _check_lm(hf)
    policy = Policy("sinks", window, sinks, bits=bits, fp_sinks=bool(fp_sinks and bits and sinks))
    pos = decoder_positions(hf)
    why = _refusal(pos, window, context_length(hf))
    if why:
        raise ValueError(why)
    ropes = [
        None if f is None else RopeSpec(f.detach().double().cpu(), pos.rotary_style or "half") for f in pos.inv_freq
    ]
    return StreamingCache(
        len(ropes),
        ropes,
        policy.window,
        sinks=(policy.sinks,),
        bits=(policy.bits,),
        fp_tokens=(policy.sinks if policy.fp_sinks else 0,),
    )
