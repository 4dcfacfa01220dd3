"""Fixed layouts for the figures: margins in inches, so a figure is laid out without measuring its text;
and cheaper log axes.

``fig.tight_layout()`` measures every tick label, label and title, which takes a draw of its own and about a
third of a figure's cost. The figures here have fixed sizes and text of known extent, so each one states its
margins in inches (they hold at any figure width or height) and :func:`place_axes` turns them into
``subplots_adjust`` fractions. Titles are set at a fixed height with :func:`set_title`, since matplotlib
otherwise measures the tick labels at each draw to see whether the title must move up. Log axes
(:func:`set_log_scale`) write their labels (10², 2×10⁻¹) with Unicode superscripts, not mathtext, which
is parsed once per label, and have minor ticks only where they span less than 3 decades. :func:`flat_bars`
draws a row of background bars as one patch.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import textwrap

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import LogFormatterSciNotation, LogLocator


def new_or_given(ax, figsize: tuple[float, float]):
    """``(fig, ax, own)``: a new one-axes figure of ``figsize`` when ``ax`` is None (``own``), else ``ax``'s figure.

    Parameters
    ----------
    ax : matplotlib.axes.Axes or None
    figsize : tuple of (float, float)
        Inches.

    Returns
    -------
    fig : matplotlib.figure.Figure
    ax : matplotlib.axes.Axes
    own : bool
        Whether the figure is new.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax, True
    return ax.figure, ax, False


_AX_DOC = """
ax : matplotlib.axes.Axes, optional
    Draw into it (default: a new figure)."""
_RETURNS_DOC = """

Returns
-------
matplotlib.figure.Figure"""


def returns_figure(draw):
    """Decorate a figure function: end its docstring's ``Parameters`` with ``ax`` (where it takes one) and add
    ``Returns`` a figure, the two entries every figure function shares.

    Parameters
    ----------
    draw : callable
        A figure function whose docstring ends with its ``Parameters``.

    Returns
    -------
    callable
        ``draw``, its docstring completed.
    """
    tail = (_AX_DOC if "ax" in inspect.signature(draw).parameters else "") + _RETURNS_DOC
    draw.__doc__ = draw.__doc__.rstrip() + textwrap.indent(tail, "    ") + "\n    "
    return draw


def one_axes(figsize: tuple[float, float], *, tight: bool = False, **margins):
    """Decorate a figure function that draws into one axes ``ax``: the wrapper makes a figure of ``figsize`` when
    ``ax`` is None (:func:`new_or_given`), has the function draw into it, places the axes with ``margins``
    (:func:`place_axes`; ``tight``: ``fig.tight_layout()`` instead) and returns the figure (:func:`returns_figure`).

    Parameters
    ----------
    figsize : tuple of (float, float)
        Inches.
    tight : bool
        Lay the figure out by ``tight_layout``, the caller's figure too.
    **margins
        Passed on to :func:`place_axes`.

    Returns
    -------
    callable
        The decorator.
    """

    def decorate(draw):
        @functools.wraps(draw)
        def plot(*args, ax=None, **kwargs):
            fig, ax, own = new_or_given(ax, figsize)
            draw(*args, ax=ax, **kwargs)
            if tight:
                fig.tight_layout()
                return fig
            return place_axes(fig, own=own, **margins)

        return returns_figure(plot)

    return decorate


def place_axes(
    fig,
    *,
    left: float = 0.75,
    bottom: float = 0.58,
    right: float = 0.17,
    top: float = 0.36,
    wspace: float = 0.0,
    hspace: float = 0.0,
    own: bool = True,
):
    """Place the figure's grid of subplots with these margins, and these gaps between its columns (``wspace``)
    and rows (``hspace``), all in inches. A colour bar made with ``fig.colorbar(..., ax=ax)`` sits inside its
    axes' cell, so the margin or gap beside it holds only the bar's tick labels and label.

    ``own=False`` (the figure is the caller's, drawn into one of its axes): laid out by ``tight_layout`` as
    before, since its other axes are not known here.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    left, bottom, right, top : float
        Margins, inches.
    wspace, hspace : float
        Gaps between columns and rows, inches.
    own : bool
        Whether the figure is the function's own.

    Returns
    -------
    matplotlib.figure.Figure
        ``fig``, placed.
    """
    if not own:
        fig.tight_layout()
        return fig
    width, height = fig.get_size_inches()
    nrows, ncols = fig.axes[0].get_subplotspec().get_topmost_subplotspec().get_gridspec().get_geometry()
    mean_w = (width - left - right - wspace * (ncols - 1)) / ncols  # subplots_adjust wants the gaps as fractions
    mean_h = (height - top - bottom - hspace * (nrows - 1)) / nrows  # of the mean axes width and height
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - top / height,
        wspace=wspace / mean_w,
        hspace=hspace / mean_h,
    )
    return fig


def set_title(ax, label: str, **kwargs):
    """``ax.set_title`` at the top of the axes (``y=1``), where it would be anyway with no tick labels on top;
    given ``y``, matplotlib does not measure the axes at each draw to place it.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    label : str
    **kwargs
        Passed on to ``ax.set_title``.

    Returns
    -------
    matplotlib.text.Text
    """
    return ax.set_title(label, y=1.0, **kwargs)


_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


class PlainLogFormatter(LogFormatterSciNotation):
    """matplotlib's log-axis labels (the same ticks labelled, the same values) as plain text: ``10²``,
    ``2×10⁻¹`` with Unicode superscripts instead of mathtext's ``$\\mathdefault{10^{2}}$``."""

    def __call__(self, x, pos=None):
        label = super().__call__(x, pos)
        body = re.fullmatch(r"\$\\mathdefault\{(.*)\}\$", label)
        if body is None:
            return label
        text = body.group(1).replace("\\times", "×")
        return re.sub(r"\^\{([^}]*)\}", lambda power: power.group(1).translate(_SUPERSCRIPT), text)


class FewDecadesMinorLocator(LogLocator):
    """matplotlib's minor ticks of a log axis (2..9 times each power of ten) where the axis spans fewer than
    ``max_decades`` decades; none where it spans more: there the labelled decades suffice, and 8 ticks a
    decade (each an artist to make and draw) would cost more than the rest of the axis."""

    def __init__(self, max_decades: float = 3):
        super().__init__(subs="auto")
        self.max_decades = max_decades

    def tick_values(self, vmin, vmax):
        if vmin > 0 and vmax > 0 and abs(math.log10(vmax / vmin)) >= self.max_decades:
            return np.array([])
        return super().tick_values(vmin, vmax)


def set_log_scale(ax, *, which: str = "y") -> None:
    """``ax.set_yscale("log")`` (``which="x"``: the x axis) with :func:`log_axis_ticks`.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    which : {"y", "x"}

    Returns
    -------
    None
    """
    getattr(ax, f"set_{which}scale")("log")
    log_axis_ticks(getattr(ax, f"{which}axis"))


def log_axis_ticks(axis) -> None:
    """On a log axis (an ``ax.yaxis``, or a log colour bar's ``cbar.long_axis``): labels by
    :class:`PlainLogFormatter` (minor ticks labelled where matplotlib labels them, on an axis spanning less
    than about a decade), minor ticks by :class:`FewDecadesMinorLocator`.

    Parameters
    ----------
    axis : matplotlib.axis.Axis

    Returns
    -------
    None
    """
    axis.set_major_formatter(PlainLogFormatter())
    axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
    axis.set_minor_locator(FewDecadesMinorLocator())


def flat_bars(ax, x, height, *, width: float = 0.8, **kwargs):
    """Bars from 0 at increasing ``x`` (at least ``width`` apart), no edges: the picture of
    ``ax.bar(x, height, width, **kwargs)``, drawn as one filled ``ax.stairs`` patch with zero steps between the
    bars, so one artist instead of a Rectangle per bar (each about 0.8 ms to make and draw). NaN heights draw
    nothing, as in ``ax.bar``. Returns the ``StepPatch`` (its ``label`` gives the legend the same box).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    x, height : array-like, shape (n,)
    width : float
    **kwargs
        Passed on to ``ax.stairs``.

    Returns
    -------
    matplotlib.patches.StepPatch
    """
    x = np.asarray(x, dtype=float)
    edges = np.column_stack([x - width / 2, x + width / 2]).ravel()
    steps = np.column_stack([np.nan_to_num(np.asarray(height, dtype=float)), np.zeros(len(x))]).ravel()[:-1]
    return ax.stairs(steps, edges, baseline=0, fill=True, **kwargs)
