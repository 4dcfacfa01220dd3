"""The report's HTML kit: figures and tables as HTML, the ``Section`` a runner fills, the findings grouped by link of
the chain, and the page. Nothing here computes a number: it lays out what the sections hold."""

from __future__ import annotations

import base64
import gc
import html
import io
import os
import pickle
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

# The chain, link by link, then what a sink does and where else sinks are: (key, title) in the order the Findings
# section gives them; each section's findings go to its link (its registered ``Section.link``) unless it names another.
LINKS = (
    ("spike", "The spike"),
    ("norm", "The norm"),
    ("key", "The key"),
    ("attention", "The attention"),
    ("value", "The value"),
    ("cuts", "The causal cuts"),
    ("dormant", "What a sink does for its head"),
    ("every_sink", "Every sink"),
    ("context", "Context length"),
)


def figure_html(fig, *, caption: str = "", dpi: int = 90) -> str:
    """A matplotlib figure as an inline base64 PNG ``<figure>``; closes the figure.

    The figure functions lay themselves out (fixed margins, ``analysis.figures.layout``), so it is drawn once, not
    measured by a draw first (``bbox_inches="tight"``). Glyphs are drawn unhinted (about a tenth of the drawing time
    saved; at 90 dpi they look the same), and zlib level 1 encodes the PNG in about half the time of the default 6, for
    ~5% more bytes.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    caption : str
        The caption (and the image's alt text).
    dpi : int
        Resolution.

    Returns
    -------
    str
        HTML.
    """
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    with plt.rc_context({"text.hinting": "no_hinting"}):
        fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}"/>{cap}</figure>'


def table_html(df: pd.DataFrame, *, digits: int = 3, max_rows: int = 40) -> str:
    """A DataFrame as an HTML table.

    Parameters
    ----------
    df : pandas.DataFrame
    digits : int
        Decimals of floats.
    max_rows : int
        Rows shown (the first ones).

    Returns
    -------
    str
        HTML.
    """
    return df.head(max_rows).to_html(
        index=False, float_format=lambda v: f"{v:.{digits}f}", classes="tbl", border=0, escape=True
    )


@dataclass
class Finding:
    """One finding: whole sentences as a result built them, the link of the chain it belongs to, and whether it is
    that link's headline.

    Attributes
    ----------
    link : str
        The link of the chain ("spike", "norm", "key", "attention", "value", "cuts", ...).
    text : str
        Whole sentences.
    headline : bool
        Whether it heads its link in the Findings section.
    """

    link: str
    text: str
    headline: bool = False


@dataclass
class Section:
    """One section of the report as it is built.

    Attributes
    ----------
    key : str
        Its name in the report and in the JSON.
    title : str
        Its heading.
    link : str
        The link of the chain its findings go to (``LINKS``), unless a finding names another.
    parts : list of str
        HTML fragments, in order.
    data : dict
        The JSON payload.
    findings : list of str
        Sentences, each one finding (also in the summary at the top).
    notes : list of str
        Plain statements: not applicable, not available.
    about : list of str
        How its numbers were measured (a criterion, a subset of the probes): shown in the section, not as notes.
    errors : list of str
        What failed (the section or one of its figures).
    seconds : float
        The time it took.
    """

    key: str
    title: str
    link: str = ""  # the link of the chain its findings go to
    parts: list[str] = field(default_factory=list)  # HTML fragments
    data: dict = field(default_factory=dict)  # JSON payload
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # plain statements: not applicable, not available
    about: list[str] = field(default_factory=list)  # how its numbers were measured (criterion, subset)
    errors: list[str] = field(default_factory=list)  # what failed (the section or one of its figures)
    seconds: float = 0.0

    def say(self, findings: str | list[str], *, link: str | None = None, headline: int | None = None) -> None:
        """Findings, each a whole sentence (or a few) as the result built it: shown in the section and gathered by
        ``link`` (default: the section's) in the Findings section. ``headline``: the index of the one that heads
        its link (else the link's first finding does)."""
        for i, text in enumerate([findings] if isinstance(findings, str) else findings):
            if text:
                self.findings.append(Finding(link or self.link, text, i == headline))
                self.parts.append(f'<p class="finding">{html.escape(text)}</p>')

    def note(self, sentence: str) -> None:
        self.notes.append(sentence)
        self.parts.append(f'<p class="note">{html.escape(sentence)}</p>')

    def explain(self, sentence: str) -> None:
        """How the section's numbers were measured (a criterion, a subset of the probes): said in the section."""
        self.about.append(sentence)
        self.parts.append(f'<p class="small">{html.escape(sentence)}</p>')

    def error(self, what: str, exc: BaseException) -> None:
        self.failed(what, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=4))

    def failed(self, what: str, message: str, trace: str, *, at: int | None = None) -> None:
        """What failed, said as ``error`` says it, from its message and traceback text (a figure encoded elsewhere):
        added to the section's parts, or put in part ``at``."""
        self.errors.append(f"{what}: {message}" if what else message)
        div = f'<div class="error">{html.escape(what + chr(10) if what else "")}{html.escape(trace)}</div>'
        if at is None:
            self.parts.append(div)
        else:
            self.parts[at] = div

    def figure(self, make: Callable, caption: str) -> None:
        """Add a figure: ``make()`` returns it. It is drawn and encoded as PNG by ``render_figures`` with every
        section's figures, after the sections; one that fails to draw or encode is shown in its place with its
        error and fails the report (its numbers stay in the JSON). ``make`` must not depend on what changes later
        (bind a loop's variables as default arguments)."""
        self.parts.append(_Drawn(make, caption))


@dataclass
class _Drawn:
    """A figure a section asked for, waiting for ``render_figures`` to draw and encode it."""

    make: Callable
    caption: str


def render_figures(sections: list[Section], *, workers: int | None = None) -> int:
    """Draw and encode every figure the sections asked for as an inline PNG, in place of its placeholder; a figure
    that fails to draw or encode is its section's error, in its place.

    Drawing a figure and encoding it (matplotlib lays out its ticks and text and rasterises it) run on one core. So
    the figures are made together at the end, shared among up to ``workers`` processes forked from this one (default:
    the CPUs this process may use, at most 4), which the model's passes no longer need: a forked worker sees the
    results the sections hold. Where ``os.fork`` is not used (not Linux) or one CPU is free, they are made here one
    after another; a worker that fails leaves its figures to be made here.

    Parameters
    ----------
    sections : list of Section
    workers : int, optional
        Processes drawing at once, this one included.

    Returns
    -------
    int
        The number of figures made.
    """
    slots = [(s, i) for s in sections for i, part in enumerate(s.parts) if isinstance(part, _Drawn)]
    drawn = [s.parts[i] for s, i in slots]
    for (s, i), d, (page_html, error) in zip(slots, drawn, _encode(drawn, workers)):
        if error is None:
            s.parts[i] = page_html
        else:  # its message and traceback in its place, as for a figure that failed to draw
            s.failed(f"figure '{d.caption}'", *error, at=i)
    return len(slots)


def _encode_one(drawn: _Drawn) -> tuple[str | None, tuple[str, str] | None]:
    """(HTML, None), or (None, (message, traceback text)) where drawing or encoding failed."""
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    try:
        return figure_html(drawn.make(), caption=drawn.caption), None
    except Exception as e:  # noqa: BLE001 - reported on its section by render_figures
        for num in set(plt.get_fignums()) - before:  # a figure left half drawn: out of pyplot's registry
            plt.close(num)
        return None, (f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _encode(figs: list[_Drawn], workers: int | None) -> list:
    n = min(workers or _cpus(), 4, len(figs))
    if n < 2 or sys.platform != "linux":
        return [_encode_one(d) for d in figs]
    shares = [list(range(w, len(figs), n)) for w in range(n)]  # interleaved: the figures' costs spread evenly
    children, here = [], list(shares[0])
    for share in shares[1:]:
        child = _fork_worker(figs, share)
        if child is None:  # no process to spare: this share is encoded here
            here += share
        else:
            children.append((*child, share))
    done: list = [None] * len(figs)
    for i in here:
        done[i] = _encode_one(figs[i])
    for pid, path, share in children:
        for i, r in zip(share, _worker_output(figs, pid, path, share)):
            done[i] = r
    return done


def _fork_worker(figs: list[_Drawn], share: list[int]) -> tuple[int, str] | None:
    """Fork a process that encodes the figures ``share`` and pickles them into a temporary file: (its pid, the file),
    or None, with a warning, where no process can be forked."""
    fd, path = tempfile.mkstemp(prefix="sink-report-figures-", suffix=".pkl")
    os.close(fd)
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork in a process with threads (torch's idle CPU workers here): the child
            # draws with matplotlib's Agg (its tensor work on one thread), takes no lock those threads hold,
            # prints nothing, leaves by os._exit.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as e:
        os.unlink(path)
        warnings.warn(
            f"could not fork a figure worker ({e}); its {len(share)} figures are encoded in this process.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    if pid == 0:  # the child: encode its share, write it, exit without the parent's exit handlers
        code = 1
        try:
            sys.stdout = sys.stderr = open(os.devnull, "w")  # a notebook's streams belong to the parent's threads
            warnings.simplefilter("ignore")
            gc.freeze()  # the parent's objects: never scanned by this worker's collections (nor copied by them)
            if "torch" in sys.modules:  # a figure's own tensor work runs inline: no thread pool after a fork
                sys.modules["torch"].set_num_threads(1)
            with open(path, "wb") as f:
                pickle.dump([_encode_one(figs[i]) for i in share], f)
            code = 0
        finally:
            os._exit(code)
    return pid, path


def _worker_output(figs: list[_Drawn], pid: int, path: str, share: list[int]) -> list:
    """The encoded figures ``share`` of the forked worker ``pid``, read from its file once it exits (the file
    removed); encoded in this process, with a warning, where the worker failed."""
    got, why = None, ""
    try:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            with open(path, "rb") as f:
                got = pickle.load(f)
        else:
            why = f"exit status {code}"
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        why = f"{type(e).__name__}: {e}"
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if not isinstance(got, list) or len(got) != len(share):  # the worker failed: its figures are encoded here
        warnings.warn(
            f"a figure worker failed ({why or 'its output was unreadable'}); its {len(share)} figures "
            "were encoded in this process.",
            RuntimeWarning,
            stacklevel=4,
        )
        got = [_encode_one(figs[i]) for i in share]
    return got


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}h3{font-size:1.05em}
.finding{background:#f3f7fb;border-left:4px solid #4c72b0;padding:.4em .7em}
.note{background:#fff7e6;border-left:4px solid #dd8452;padding:.4em .7em}
.error{background:#fdecea;border-left:4px solid #c44e52;padding:.4em .7em;white-space:pre-wrap;font-family:monospace;font-size:.85em}
figure{margin:1em 0}figure img{max-width:100%}figcaption{color:#555;font-size:.9em}
table.tbl{border-collapse:collapse;font-size:.85em;margin:.6em 0}table.tbl td,table.tbl th{border:1px solid #ddd;padding:2px 6px;text-align:right}
.cv{border:1px solid #eee;padding:.3em;margin:.5em 0}.small{color:#666;font-size:.85em}
.link{margin:.4em 0;padding:.3em .7em;border-left:4px solid #4c72b0;background:#f3f7fb}
details.link summary{cursor:pointer}details.link ul{margin:.4em 0;font-size:.95em}
"""


def chain_findings(sections: list[Section]) -> list[dict]:
    """The findings grouped by link of the chain, in ``LINKS`` order: per link with any finding its ``link`` key,
    ``title``, ``headline`` (the finding said as its headline, else its first) and ``details`` (the others, in the
    order the sections said them).

    Parameters
    ----------
    sections : list of Section
        The report's sections, each with its findings.

    Returns
    -------
    list of dict
    """
    out = []
    for key, title in LINKS:
        found = [f for s in sections for f in s.findings if f.link == key]
        if found:
            head = next((f for f in found if f.headline), found[0])
            out.append(
                {
                    "link": key,
                    "title": title,
                    "headline": head.text,
                    "details": [f.text for f in found if f is not head],
                }
            )
    return out


def _findings_html(chain: list[dict]) -> str:
    """One headline per link; its details folded under it."""
    esc, out = html.escape, []
    for c in chain:
        head = f"<b>{esc(c['title'])}.</b> {esc(c['headline'])}"
        if c["details"]:
            items = "".join(f"<li>{esc(d)}</li>" for d in c["details"])
            out.append(f'<details class="link"><summary>{head}</summary><ul>{items}</ul></details>')
        else:
            out.append(f'<p class="link">{head}</p>')
    return "".join(out)


def page(name: str, intro: str, note: str, sections: list[Section], versions: str) -> str:
    """The self-contained HTML page: the model, the samples' note, the findings by link, what failed or does not
    apply, the contents and every section.

    Parameters
    ----------
    name : str
        The model's name.
    intro : str
        HTML: the model's dims, the probes and the time taken.
    note : str
        Plain text: which sequences each Sink_1 is measured on.
    sections : list of Section
    versions : str
        The package versions.

    Returns
    -------
    str
        HTML.
    """
    esc = html.escape
    findings = _findings_html(chain_findings(sections))
    notes = "".join(f"<li>{esc(s.title)}: {esc(n)}</li>" for s in sections for n in s.notes)
    errors = "".join(f"<li>{esc(s.title)}: {esc(e)}</li>" for s in sections for e in s.errors)
    toc = "".join(f'<li><a href="#{s.key}">{esc(s.title)}</a></li>' for s in sections)
    body = []
    for s in sections:
        body.append(f'<h2 id="{s.key}">{esc(s.title)}</h2>')
        body.extend(s.parts)
        body.append(f'<p class="small">{s.seconds:.1f} s</p>')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"/><meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>Attention sinks: {esc(name)}</title><style>{_CSS}</style></head>
<body>
<h1>Attention sinks in {esc(name)}</h1>
{intro}
<p class="note">{esc(note)}</p>
<h2>Findings</h2><p class="small">The chain link by link, then what a sink does and where else sinks are: one
headline each; open it for the details.</p>{findings}
{f'<h2>Failed</h2><ul class="error">{errors}</ul>' if errors else ""}
{f"<h2>Not applicable or not available</h2><ul>{notes}</ul>" if notes else ""}
<h2>Contents</h2><ul>{toc}</ul>
{"".join(body)}
<hr/><p class="small">Package versions: {esc(versions)}.</p>
</body></html>
"""


def document(title: str, body: str) -> str:
    """A self-contained HTML page in the report's style around ``body`` (the atlas' page; ``page`` is the report's).

    Parameters
    ----------
    title : str
        Plain text: the page's title and heading.
    body : str
        HTML.

    Returns
    -------
    str
        HTML.
    """
    esc = html.escape
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"/><meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>{esc(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{esc(title)}</h1>
{body}
</body></html>
"""
