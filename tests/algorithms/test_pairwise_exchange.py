"""Pairwise exchange: finishes, pairs like halving-doubling, S / C per step."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.pairwise_exchange import pairwise_exchange
from totalreduce.algorithms.schedule import balanced_parts
from totalreduce.algorithms.simulator import simulate


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_pairwise_exchange_moves_one_part_per_step(p: int, in_place: bool) -> None:
    lg = p.bit_length() - 1
    for c in range(1, lg + 1):
        for n in [0, 1, 7, 1000]:
            xs = [np.arange(n, dtype=np.int64) * p + r for r in range(p)]
            schedules = [pairwise_exchange(r, p, n, steps=c) for r in range(p)]
            outs = simulate(schedules, xs, segment_elems=97, in_place=in_place, seed=c * 31 + n)
            parts = balanced_parts(n, c)
            for r, out in enumerate(outs):
                for k, (off, m) in enumerate(parts):
                    partner = r ^ (1 << k)
                    np.testing.assert_array_equal(
                        out[off : off + m],
                        np.arange(off, off + m, dtype=np.int64) * p + partner,
                        err_msg=f"P={p} C={c} n={n} rank={r} step={k}",
                    )


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_pairwise_exchange_steps_and_bytes(p: int) -> None:
    lg = p.bit_length() - 1
    for c in range(1, lg + 1):
        n = c * 100
        for r in range(p):
            s = pairwise_exchange(r, p, n, steps=c)
            assert len(s.steps) == c
            assert s.bytes_sent(8) == 8 * n
            for k, st in enumerate(s.steps):
                assert [x.peer for x in st.sends] == [r ^ (1 << k)]
                assert st.sends[0].region.count == n // c == st.recvs[0].region.count


def test_pairwise_exchange_rejects_bad_sizes_and_steps() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        pairwise_exchange(0, 6, 10, steps=1)
    with pytest.raises(ValueError, match="power-of-two"):
        pairwise_exchange(0, 1, 10, steps=1)
    with pytest.raises(ValueError, match="1..3 steps"):
        pairwise_exchange(0, 8, 10, steps=4)
    with pytest.raises(ValueError, match="1..3 steps"):
        pairwise_exchange(0, 8, 10, steps=0)
