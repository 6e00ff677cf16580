"""The compiled lane under real MPI: ``mpiexec -n P`` runs of ``check_lane.py``, each with a
timeout (the lane is on by default in embedded mode over MPI)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch_modes import Launches, mpiexec  # noqa: E402

from conftest import full_run  # noqa: E402
from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

HERE = Path(__file__).parent
TIMEOUT = 150

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)


def _start(n: Any, modes: list[str], where: str) -> str:
    argv = [str(HERE / "check_lane.py"), ",".join(modes)]
    # the lane runs by default: a TOTALREDUCE_LANE of the caller's stays out
    return mpiexec(n, argv, TIMEOUT + 30 * len(modes), unset=("TOTALREDUCE_LANE",))


#: The tests at one size share one launch of check_lane.py (a process start costs more
#: than most checks).
LAUNCHES = Launches(_start)


def sizes(ranks: list[int], mode: str, full: tuple[int, ...] = ()) -> Any:
    """The sizes a test of check_lane.py's ``mode`` runs at, planned into their launches;
    those in ``full`` run (and are planned) with ``pytest --full`` only."""
    every = full_run()
    for n in ranks:
        if every or n not in full:
            LAUNCHES.plan(n, mode)
    return pytest.mark.parametrize(
        "n", [pytest.param(n, marks=pytest.mark.full) if n in full else n for n in ranks]
    )


def lane_run(n: int, mode: str) -> str:
    """``mode``'s lines from the launch at ``n`` ranks (AssertionError: the whole output)."""
    out, whole = LAUNCHES.lines(n, mode)
    marker = f"{mode.upper()} OK"
    assert out.count(marker) == n, whole
    return out


@sizes([2, 3], "exact", full=(3,))
def test_lane_exact_for_every_type_op_and_algorithm(n: int) -> None:
    lane_run(n, "exact")


@sizes([2, 3], "flood", full=(3,))
def test_lane_ten_thousand_ops_in_flight_in_random_orders(n: int) -> None:
    lane_run(n, "flood")


@sizes([2], "credit")
def test_lane_frames_beyond_credit_wait_for_ready_without_deadlock(n: int) -> None:
    lane_run(n, "credit")


@sizes([3], "mismatch")
def test_lane_mismatches_raise_on_every_rank(n: int) -> None:
    lane_run(n, "mismatch")


@sizes([2, 3], "large", full=(3,))
def test_lane_large_ops_travel_as_bodies_exact_in_any_order(n: int) -> None:
    lane_run(n, "large")


@sizes([3], "kinds")
def test_lane_runs_small_reduce_scatters_and_allgathers_exactly(n: int) -> None:
    lane_run(n, "kinds")


@sizes([2], "nap")
def test_lane_a_waiter_with_naps_sleeps_while_a_large_ops_peer_is_late(n: int) -> None:
    lane_run(n, "nap")


@sizes([2], "outer")
def test_lane_a_waiter_that_watches_outer_words_is_back_when_they_move(n: int) -> None:
    lane_run(n, "outer")


@sizes([2], "crowd")
def test_lane_large_receives_beyond_its_requests_wait_their_turn(n: int) -> None:
    lane_run(n, "crowd")


@sizes([3], "express")
def test_lane_express_repeats_are_exact_and_mismatches_still_raise_everywhere(n: int) -> None:
    lane_run(n, "express")


@sizes([3], "stall")
def test_lane_stall_shutdown_fails_the_op_on_every_rank(n: int) -> None:
    lane_run(n, "stall")


@sizes([2], "threads")
def test_lane_threads_wait_on_their_own_ops(n: int) -> None:
    lane_run(n, "threads")


@sizes([3], "peer_error")
def test_lane_error_from_a_peer_fails_the_op_everywhere(n: int) -> None:
    lane_run(n, "peer_error")


@sizes([2], "background")
def test_lane_ops_progress_on_the_comm_thread_without_the_interpreter_lock(n: int) -> None:
    lane_run(n, "background")


@sizes([2], "absent_peer")
def test_lane_op_waiting_for_a_late_peer_costs_little_cpu(n: int) -> None:
    lane_run(n, "absent_peer")


@sizes([2, 4], "early", full=(4,))
def test_lane_early_ops_of_other_ranks_stay_within_the_pool(n: int) -> None:
    lane_run(n, "early")


@sizes([2], "early_small")
def test_lane_early_small_ops_coalesced_stay_within_the_pool(n: int) -> None:
    lane_run(n, "early_small")


@sizes([2, 3], "hostile")
def test_lane_a_hostile_peer_is_refused_and_the_receiver_stays_within_the_pool(n: int) -> None:
    lane_run(n, "hostile")
