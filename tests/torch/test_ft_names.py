"""``totalreduce.torch.ft`` without services: torchft's names exist, what has no equivalent
fails naming it, and fault-tolerant mode without a service is a clear error (issue 50)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

import totalreduce.torch.ft as ft
from totalreduce.errors import TotalReduceError


def test_torchft_names_exist() -> None:
    for name in ("Manager", "DistributedDataParallel", "DistributedSampler", "Optimizer",
                 "ProcessGroupGloo", "ProcessGroupNCCL", "PGTransport"):  # fmt: skip
        assert hasattr(ft, name), name
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=5))
    assert ft.PGTransport(pg, timeout=timedelta(seconds=10), device="cpu").pg is pg


def test_no_service_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOTALREDUCE_FT_SOCKET", str(tmp_path / "ft0.sock"))
    with pytest.raises(TotalReduceError, match="totalreduce serve --fault-tolerant"):
        ft.Manager(ft.ProcessGroupGloo(), None, None, min_replica_size=1, replica_id="r")
    monkeypatch.delenv("TOTALREDUCE_FT_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(TotalReduceError, match=r"found 0 ft\*\.sock.*no service"):
        ft.Manager(ft.ProcessGroupGloo(), None, None, min_replica_size=1, replica_id="r")


def test_what_has_no_equivalent_is_named() -> None:
    with pytest.raises(TypeError, match="pg=builtins.object"):
        ft.Manager(object(), None, None, min_replica_size=1)
    with pytest.raises(ValueError, match="world_size_mode='fixed_with_spares'"):
        ft.Manager(ft.ProcessGroupGloo(), None, None, 1, world_size_mode="fixed_with_spares")
    with pytest.raises(ValueError, match="replica group of 4 processes"):
        ft.Manager(ft.ProcessGroupGloo(), None, None, 1, world_size=4)
    with pytest.raises(ValueError, match=r"\['find_unused_parameters'\]"):
        ft.DistributedDataParallel(None, torch.nn.Linear(2, 2), find_unused_parameters=True)


def test_sampler_shards_as_torchft() -> None:
    s = ft.DistributedSampler(list(range(12)), replica_rank=1, num_replica_groups=3,
                              group_rank=0, num_replicas=1, shuffle=False)  # fmt: skip
    assert (s.global_rank, s.global_world_size) == (1, 3)
    assert list(s) == [1, 4, 7, 10]
