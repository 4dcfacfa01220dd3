"""Where a per-tensor scale comes from, in words, tied to the first token's spike (``analysis.chain.spike_writers``)."""

from __future__ import annotations

from analysis.quant.passes import ScaleSite

OUTPUT_LINEARS = ("down_proj", "W_out", "fc2", "c_proj", "dense_4h_to_h", "w2")  # inputs are MLP neurons


def quoted_token(text: str) -> str:
    """A token's text quoted as ``repr`` quotes it, its escaped bytes (``\\xe2``, ``analysis.model.hooks.readable_text``)
    kept single-escaped.

    Parameters
    ----------
    text : str

    Returns
    -------
    str
    """
    return repr(text).replace("\\\\x", "\\x")


def scale_origin(site: ScaleSite, origin, token: str) -> str:
    """One sentence: the scale's linear, token, position and dimension, and which neurons wrote it.

    Parameters
    ----------
    site : ScaleSite
    origin : analysis.chain.spike_writers.SpikeOrigin or None
        The first token's spike origin (None: not traced).
    token : str
        The token's text.

    Returns
    -------
    str
    """
    where = (
        f"layer {site.layer} {site.linear}: |x| = {site.absmax:,.0f} on token {quoted_token(token)} at position "
        f"{site.position} of calibration window {site.window}, dim {site.dim}"
    )
    if origin is None:
        return where + "."
    if site.linear.split(".")[-1] in OUTPUT_LINEARS:
        for n in origin.neurons:
            if n.block == site.layer and site.dim in n.neurons():
                return where + (
                    f", i.e. neuron {site.dim} of MLP {site.layer}, one of the neurons that "
                    f"{'write' if n.role == 'writer' else 'erase'} the spike on residual dim {n.dim}."
                )
        return where + f", i.e. neuron {site.dim} of MLP {site.layer} (not one of the spike's writing neurons)."
    if site.dim in origin.dims:
        w, e = origin.writing_blocks(site.dim), origin.writing_blocks(site.dim, "eraser")
        return where + (
            f", the massive residual dim {site.dim} the MLPs of blocks {w or 'none'} write"
            + (f" (and blocks {e} erase)" if e else "")
            + "."
        )
    return where + " (not a spike dim)."
