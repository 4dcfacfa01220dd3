"""Sinks and quantisation: fake-quantised linear inputs and weights against the sink (as is, sink tokens in full
precision, a searched prefix), where each per-tensor scale comes from, and a KV cache that really stores low-bit
values with its sinks in full precision."""

from analysis.core.lazy import lazy_exports

_EXPORTS = {  # name -> the module that defines it, imported when the name is first asked for
    **dict.fromkeys(["LowBitCache"], "analysis.quant.kv_cache"),
    **dict.fromkeys(["quant_study"], "analysis.quant.run"),
    **dict.fromkeys(["QuantResult"], "analysis.quant.study"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["LowBitCache", "QuantResult", "quant_study"]
