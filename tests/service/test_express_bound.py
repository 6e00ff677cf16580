"""The express records stay within ``Config.express_bytes`` (service/records.py): a job that
makes a new name and count every step keeps its records' charges, and its RSS, flat."""

from __future__ import annotations

import numpy as np

from conftest import local_services, run_ranks
from totalreduce.service import express
from totalreduce.service.records import RECORD_BYTES, Records


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


def test_records_are_dropped_least_recently_used_first() -> None:
    """Past the bound the oldest record nobody repeated goes; one a repeat found since the
    last sweep stays (second chance), and the charges never pass the bound."""

    class Rec:
        __slots__ = ("used", "row")

        def __init__(self) -> None:
            self.used = False
            self.row = np.zeros(16, np.int64)

    each = RECORD_BYTES + 128
    table = Records(1 << 16)  # 15 records fit
    for k in range(15):
        table[k] = Rec()
    assert table.charged == 15 * each and table.evicted == 0
    table[0].used = True  # a repeat found it
    table[15] = Rec()
    assert 0 in table and 1 not in table, sorted(table)
    assert table.charged <= table.bound and table.charged == each * len(table)
    for k in range(16, 200):
        table[k] = Rec()
        assert table.charged <= table.bound
    assert len(table) * each == table.charged and 199 in table
    del table[199]
    assert table.charged == each * len(table)
    table.clear()
    assert table.charged == 0 and not table.charges


def test_rss_stays_flat_with_ten_thousand_new_names_and_counts() -> None:
    """10,000 blocking allreduces, each a new name and (of 5,000) a new count, with
    ``express_bytes`` at 1 MiB (and the lane's plans at 512 KiB): the records' charges
    stay within it, the newest name's repeat still takes its record, and RSS (both ranks
    of this process) over the last 7,000 grows by what is kept per name elsewhere (a named
    op's next generation, for good, and the wire id cache's 65,536 names: measured 18 MiB,
    some 650 bytes a name) and not by the records' 4 KiB each (unbounded: 112 MiB)."""
    bound = 1 << 20
    warm, measured = 3000, 7000

    def body(s):
        rss = 0.0
        for i in range(warm + measured):
            if i == warm:
                rss = _rss_mib()
            n = 1 + i % 5000
            out = s.allreduce(np.full(n, s.rank + 1, np.int32), name=f"step{i}")
            assert out.shape == (n,) and out[0] == 3 and out[-1] == 3, (i, out[:3])
        grown = _rss_mib() - rss
        table = s._express
        assert isinstance(table, Records) and table.charged <= bound, table.charged
        assert table.evicted > warm, table.evicted
        x = np.full(7, 1, np.int32)
        s.allreduce(x, name="last")
        assert express.lookup(table, ("last", "sum", False, None), x) is not None
        return grown

    with local_services(2, express_bytes=bound, lane_plan_bytes=512 << 10) as svcs:
        grown = run_ranks(svcs, body, timeout=600)[0]
    per_name = grown * (1 << 20) / (2 * measured)
    assert per_name < 1500, f"RSS grew {grown:.1f} MiB over {measured} new names a rank"
