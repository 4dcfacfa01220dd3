"""frozen_heap: the objects alive on entry are out of the collector's scans for the duration, and handed back."""

import gc

from analysis.core.memory import frozen_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_heap_is_frozen_inside_and_handed_back_after():
    assert gc.get_freeze_count() == 0
    old = _Cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        new = _Cycle()
        assert gc.is_tracked(new)
        del new
        assert gc.collect() >= 1  # what the job makes is still collected
    assert gc.get_freeze_count() == 0
    del old
    assert gc.collect() >= 1  # the objects alive on entry are collectable again


def test_a_heap_the_process_froze_itself_stays_frozen():
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == n
    finally:
        gc.unfreeze()


def test_the_heap_is_handed_back_when_the_job_fails():
    try:
        with frozen_heap():
            raise ValueError("the job failed")
    except ValueError:
        pass
    assert gc.get_freeze_count() == 0
