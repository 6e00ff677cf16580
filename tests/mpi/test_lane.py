"""The compiled lane under real MPI: ``mpiexec -n P`` runs of ``check_lane.py``, each with a
timeout (the lane is on by default in embedded mode over MPI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT = 150

pytestmark = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec not on PATH (install the mpich wheel)"
)


def lane_run(n: int, mode: str) -> str:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONUNBUFFERED="1")
    env.pop("TOTALREDUCE_LANE", None)
    proc = subprocess.run(
        ["mpiexec", "-n", str(n), sys.executable, str(HERE / "check_lane.py"), mode],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"mpiexec -n {n} check_lane.py {mode} exited {proc.returncode}:\n{out}"
    )
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_lane_exact_for_every_type_op_and_algorithm(n: int) -> None:
    out = lane_run(n, "exact")
    assert out.count("EXACT OK") == n, out


@pytest.mark.parametrize("n", [3])
def test_lane_ten_thousand_ops_in_flight_in_random_orders(n: int) -> None:
    out = lane_run(n, "flood")
    assert out.count("FLOOD OK") == n, out


@pytest.mark.parametrize("n", [2])
def test_lane_frames_beyond_credit_wait_for_ready_without_deadlock(n: int) -> None:
    out = lane_run(n, "credit")
    assert out.count("CREDIT OK") == n, out


@pytest.mark.parametrize("n", [3])
def test_lane_mismatches_raise_on_every_rank(n: int) -> None:
    out = lane_run(n, "mismatch")
    assert out.count("MISMATCH OK") == n, out


@pytest.mark.parametrize("n", [2, 3])
def test_lane_large_ops_travel_as_bodies_exact_in_any_order(n: int) -> None:
    out = lane_run(n, "large")
    assert out.count("LARGE OK") == n, out


@pytest.mark.parametrize("n", [3])
def test_lane_runs_small_reduce_scatters_and_allgathers_exactly(n: int) -> None:
    out = lane_run(n, "kinds")
    assert out.count("KINDS OK") == n, out


def test_lane_large_receives_beyond_its_requests_wait_their_turn() -> None:
    out = lane_run(2, "crowd")
    assert out.count("CROWD OK") == 2, out


def test_lane_express_repeats_are_exact_and_mismatches_still_raise_everywhere() -> None:
    out = lane_run(3, "express")
    assert out.count("EXPRESS OK") == 3, out


def test_lane_stall_shutdown_fails_the_op_on_every_rank() -> None:
    out = lane_run(3, "stall")
    assert out.count("STALL OK") == 3, out


def test_lane_threads_wait_on_their_own_ops() -> None:
    out = lane_run(2, "threads")
    assert out.count("THREADS OK") == 2, out


def test_lane_error_from_a_peer_fails_the_op_everywhere() -> None:
    out = lane_run(3, "peer_error")
    assert out.count("PEER_ERROR OK") == 3, out


def test_lane_ops_progress_on_the_comm_thread_without_the_interpreter_lock() -> None:
    out = lane_run(2, "background")
    assert out.count("BACKGROUND OK") == 2, out


def test_lane_op_waiting_for_a_late_peer_costs_little_cpu() -> None:
    out = lane_run(2, "absent_peer")
    assert out.count("ABSENT_PEER OK") == 2, out
