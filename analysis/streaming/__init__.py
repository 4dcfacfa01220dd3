"""StreamingLLM and sink-aware KV caches: perplexity of a causal LM on a long stream under bounded caches.

    from analysis import load_model
    from analysis.streaming import streaming_perplexity
    res = streaming_perplexity(load_model("smollm2-135m"), window=256, n_tokens=2048)
    res.table          # one row per policy: perplexity, tokens/s, KV-cache MiB, the sinks' attention share
    res.curve()        # log-perplexity against position
    print(res.text())  # the finding in words

Modules: ``cache`` (policies, the ``transformers.Cache`` subclass, rotary re-positioning, simulated KV
quantisation), ``attention`` (the decode attention function: grouped-query steps that measure the
sinks' share inside the layer), ``perplexity`` (the decode loop and the re-computation ceiling), ``corpus`` (the offline
stream), ``backbone`` (the Hugging Face model behind a model of the contract), ``reference`` (the project's reference
models, learnable sink token included, on the same cache), ``run`` (all policies, the result), ``generate``
(``sink_cache``: the same cache for ``model.generate``).
"""

from analysis.core.lazy import lazy_exports

_EXPORTS = {  # name -> the module that defines it, imported when the name is first asked for
    **dict.fromkeys(["Policy", "StreamingCache", "fake_quantize", "rope_spec"], "analysis.streaming.cache"),
    **dict.fromkeys(["PolicyRun", "recompute_nll", "run_policies", "run_policy"], "analysis.streaming.perplexity"),
    **dict.fromkeys(
        ["StreamResult", "compare_streams", "default_policies", "streaming_perplexity"], "analysis.streaming.run"
    ),
    "sink_cache": "analysis.streaming.generate",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
