"""The node service's compiled loop (daemon/service_loop.py) beyond the allreduce: repeats
of broadcasts (every root), barriers, reduce-scatters and all-gathers (even and uneven
parts) among the nodes run there, exact in every dtype; the ops Python starts among the
nodes (a group's, and segmented ops) stay exact; a mismatch among the nodes on a shape
that has a row in the loop (a count, a root, a reduce-scatter's parts) fails every rank
with an error naming the op, its generation and the ranks, as it does with the loop
switched off (``TOTALREDUCE_SERVICE_LOOP=0``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import have_mpiexec, run_clients, serve  # noqa: E402

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec not found (mpich wheel)")
WORKER = str(HERE / "loop_kinds_worker.py")


def run_mode(
    where: Path, nodes: int, local: int, mode: str, checks: list[str], *extra: str,
    **env: str,
) -> str:  # fmt: skip
    """Serve ``nodes`` x ``local`` (``env`` in the services' and the clients' environment),
    run ``loop_kinds_worker.py mode`` on every client, and check that every rank reported
    every check OK and the services exited cleanly; the clients' output."""
    served = serve(nodes, local, where, extra=extra, **env)
    try:
        results = run_clients(served, [WORKER, mode], timeout=240, **env)
    finally:
        status = served.stop()
    for r, res in enumerate(results):
        for check in checks:
            assert f"rank {r}: {check} OK" in res.stdout, res.stdout
    log = served.stderr()
    assert status == 0, log
    assert "Traceback" not in log, log
    return "".join(r.stdout for r in results)


CHECKS = ["LOOP-BROADCAST", "LOOP-BARRIER", "LOOP-PARTED", "KINDS-EXACT", "MISMATCH-COUNT",
          "MISMATCH-ROOT", "MISMATCH-PARTS", "MISMATCH-AFTER"]  # fmt: skip


@pytest.mark.parametrize(
    "local", [1, pytest.param(2, marks=pytest.mark.full)], ids=lambda n: f"2x{n}"
)
def test_repeated_broadcasts_and_barriers_take_the_compiled_loop(
    tmp_path: Path, local: int
) -> None:
    """Two nodes: repeats of broadcasts from every root, of barriers, of reduce-scatters
    and of all-gathers (even and uneven parts) run in the loop (counted by the service),
    exact in float16/32/64, int32/64 (and a bfloat16 broadcast); a group's
    allreduces are exact.  Then the nodes disagree about a repeat's count, about a
    broadcast's root and about a reduce-scatter's parts, after repeats gave the shape its
    row: every rank fails naming the op, its generation and the ranks; the service goes
    on."""
    checks = CHECKS + (["MISMATCH-SAME-SUMS"] if local > 1 else [])
    out = run_mode(tmp_path / "s", 2, local, "kinds,mismatch", checks)
    assert "FAILED" not in out, out


@pytest.mark.full
def test_broadcasts_barriers_and_mismatches_with_the_loop_off(tmp_path: Path) -> None:
    """``TOTALREDUCE_SERVICE_LOOP=0``: the same results and errors, and the loop runs
    nothing."""
    out = run_mode(tmp_path / "s", 2, 1, "kinds,mismatch", CHECKS, TOTALREDUCE_SERVICE_LOOP="0")
    assert "FAILED" not in out, out


@pytest.mark.full
def test_segmented_ops_are_exact_and_started_by_python(tmp_path: Path) -> None:
    """Two nodes of two clients, ops cut into segments among the nodes (a small
    ``--segment-bytes``): exact, and the loop takes none (Python starts each segment)."""
    run_mode(tmp_path / "s", 2, 2, "segmented", ["SEGMENTED"], "--segment-bytes", "65536")


def group_digests(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if "GROUP-DIGEST" in line)


def group_checks_passed(out: str, local: int) -> None:
    """Every member of every group of ``loop_kinds_worker.groups_of`` reported its
    group's checks OK (the others report nothing of it)."""
    members = {"SPAN": 2, "ONE": min(local, 2), "MISMATCH-COUNT": 2, "MISMATCH-AFTER": 2,
               "RS2": 2, "RSX": 2}  # fmt: skip
    if local > 1:
        members.update({"SPAN3": 3, "MISMATCH-LOCAL": 3, "RS3": 3})
    if local > 2:
        members["ORDER"] = 5
    assert "FAILED" not in out, out
    for check, n in members.items():
        assert out.count(f": GROUP-{check} OK") == n, (check, out)
    assert len(group_digests(out)) == 2 * local, out


@pytest.mark.parametrize(
    "local", [1, pytest.param(2, marks=pytest.mark.full)], ids=lambda n: f"2x{n}"
)
def test_a_groups_repeats_take_the_compiled_loop_with_the_bits_of_python(
    tmp_path: Path, local: int
) -> None:
    """Two nodes: repeats of allreduces (sum, max, avg), broadcasts and barriers over a
    group spanning the nodes (one client on each; at 2x2 also two clients of node 0 and
    one of node 1) run in the services' compiled loop, and over a group of node 0 only in
    the compiled pass, exact in float32, float64 and int32 against the documented order
    (each node's members in group order, then the nodes); so do a group's reduce-scatters
    and all-gathers (uneven parts), where its ranks lie node after node and where its
    order interleaves the nodes (its node's part in node order); the same bits with the loop off
    (Python starts every group op among the nodes then).  Nodes that disagree on a group
    op's count, and clients of a node that disagree on its dtype, fail every member naming
    the op, its generation and the ranks."""
    env = {"LOOP_KINDS_LOCAL": str(local)}
    on = run_mode(tmp_path / "on", 2, local, "groups", [], **env)
    off = run_mode(tmp_path / "off", 2, local, "groups", [], TOTALREDUCE_SERVICE_LOOP="0", **env)
    group_checks_passed(on, local)
    group_checks_passed(off, local)
    assert group_digests(on) == group_digests(off), (group_digests(on), group_digests(off))


@pytest.mark.full  # (a compaction of the services' plans: 6 s of processes)
def test_repeats_take_the_loop_again_after_the_services_plans_are_compacted(
    tmp_path: Path,
) -> None:
    """The services' lane bounded to its least plan store (64 KiB): rounds of new shapes
    compact it, moving the plan offsets the loop's rows hold; the rows are dropped and
    made anew, and a repeated shape runs in the compiled loop again after each round,
    exact (without it the loop stayed off for good after the first compaction)."""
    run_mode(tmp_path / "s", 2, 1, "compaction", ["COMPACTION"],
             TOTALREDUCE_LANE_PLAN_BYTES="65536")  # fmt: skip
