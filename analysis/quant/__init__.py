"""Sinks and quantisation: fake-quantised linear inputs and weights against the sink (as is, sink tokens in full
precision, a searched prefix), where each per-tensor scale comes from, and a KV cache that really stores low-bit
values with its sinks in full precision."""
from analysis.quant.kv_cache import LowBitCache
from analysis.quant.run import quant_study
from analysis.quant.study import QuantResult

__all__ = ["LowBitCache", "QuantResult", "quant_study"]
