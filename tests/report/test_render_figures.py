"""The report's figures, drawn and encoded together at the end: on forked workers the same page as here, and a figure
or a worker that fails is reported, never lost."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from analysis.report import html as H  # noqa: E402


def _fig(i: int):
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot(range(5), [i * x for x in range(5)])
    ax.set_title(f"figure {i}")
    return fig


class _Broken:
    """Draws, but cannot be encoded."""

    def savefig(self, *a, **k):
        raise RuntimeError("cannot encode")


def _half_drawn():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    raise ValueError("no data to plot")


def _sections(n: int = 7, broken: int | None = None, make_broken=_Broken):
    secs = [H.Section(f"s{j}", f"S{j}") for j in range(2)]
    for i in range(n):
        sec = secs[i % 2]
        sec.say(f"finding {i}.")
        sec.figure(make_broken if i == broken else (lambda i=i: _fig(i)), f"caption {i}")
    return secs


def test_workers_encode_the_same_page_as_one_process():
    one, many = _sections(), _sections()
    assert H.render_figures(one, workers=1) == 7 and H.render_figures(many, workers=3) == 7
    assert [s.parts for s in one] == [s.parts for s in many]
    assert all(isinstance(p, str) for s in many for p in s.parts)
    assert sum(p.startswith("<figure><img") for s in many for p in s.parts) == 7
    assert not plt.get_fignums()  # drawn figures left pyplot's registry: no open-figure warning after 20


@pytest.mark.parametrize("workers", [1, 3])
def test_a_figure_that_fails_to_encode_is_its_sections_error_in_its_place(workers):
    secs = _sections(broken=3)
    H.render_figures(secs, workers=workers)
    sec = secs[1]  # figure 3 went to the second section, its second figure (parts: finding, figure, finding, ...)
    assert sec.errors == ["figure 'caption 3': RuntimeError: cannot encode"]
    assert sec.parts[3].startswith('<div class="error">') and "cannot encode" in sec.parts[3]
    assert not secs[0].errors and sum(p.startswith("<figure>") for s in secs for p in s.parts) == 6


def test_a_worker_that_dies_leaves_its_figures_to_this_process(monkeypatch):
    parent, encode = os.getpid(), H._encode_one

    def dies_in_a_worker(drawn):
        if os.getpid() != parent:
            os._exit(3)
        return encode(drawn)

    forks, fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    monkeypatch.setattr(H, "_encode_one", dies_in_a_worker)
    secs = _sections()
    with pytest.warns(RuntimeWarning, match="figure worker failed .exit status 3.; its 2 figures were encoded"):
        assert H.render_figures(secs, workers=3) == 7 and len(forks) == 2  # two workers forked, both died
    assert sum(p.startswith("<figure><img") for s in secs for p in s.parts) == 7 and not any(s.errors for s in secs)


def test_figures_are_drawn_at_the_end_not_when_a_section_asks():
    drawn = []
    sec = H.Section("s", "S")
    sec.figure(lambda: drawn.append(1) or _fig(1), "caption")
    assert not drawn and not plt.get_fignums()  # nothing drawn while the sections run
    assert H.render_figures([sec], workers=1) == 1 and drawn == [1] and sec.parts[0].startswith("<figure><img")


@pytest.mark.parametrize("workers", [1, 3])
def test_a_figure_that_fails_to_draw_is_its_sections_error_in_its_place(workers):
    kept = plt.figure()  # a figure of the caller's (a notebook's) stays open
    try:
        secs = _sections(broken=4, make_broken=_half_drawn)
        H.render_figures(secs, workers=workers)
        assert secs[0].errors == ["figure 'caption 4': ValueError: no data to plot"]
        assert secs[0].parts[5].startswith('<div class="error">') and "_half_drawn" in secs[0].parts[5]
        assert plt.get_fignums() == [kept.number]  # the half-drawn figure closed, the caller's kept
    finally:
        plt.close(kept)
