"""Options: one name as a keyword and as a TOTALREDUCE_* variable; keywords win."""

from __future__ import annotations

import pytest

import totalreduce as tr
from totalreduce.errors import InvalidArgumentError
from totalreduce.service.config import Config


def test_defaults_env_and_keywords() -> None:
    assert Config.load(env={}).segment_bytes == 1 << 20
    env = {"TOTALREDUCE_SEGMENT_BYTES": "65536", "TOTALREDUCE_ALLOW_SERIALIZED": "yes"}
    cfg = Config.load(env=env)
    assert cfg.segment_bytes == 65536 and cfg.allow_serialized is True
    assert Config.load(env=env, segment_bytes=4096).segment_bytes == 4096
    assert Config.load(env={"TOTALREDUCE_STALL_WARNING_S": "2.5"}).stall_warning_s == 2.5
    assert Config.load(env={"TOTALREDUCE_MICRO_BYTES": "0x400"}).micro_bytes == 1024


def test_bad_values_are_named() -> None:
    with pytest.raises(tr.InvalidArgumentError, match="TOTALREDUCE_SEGMENT_BYTES"):
        Config.load(env={"TOTALREDUCE_SEGMENT_BYTES": "lots"})
    with pytest.raises(tr.InvalidArgumentError, match="unknown option"):
        Config.load(env={}, segmnt_bytes=5)
    with pytest.raises(tr.InvalidArgumentError, match="segment_bytes"):
        Config.load(env={}, segment_bytes=1)
    with pytest.raises(tr.InvalidArgumentError, match="allow_serialized"):
        Config.load(env={"TOTALREDUCE_ALLOW_SERIALIZED": "maybe"})


def test_import_does_not_pull_torch_or_mpi() -> None:
    import subprocess
    import sys

    code = "import sys, totalreduce; print('torch' in sys.modules, 'mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_init_again_with_other_options_raises(monkeypatch) -> None:
    import totalreduce.api as api
    from totalreduce.service.config import Config as Cfg

    class Running:
        closed = False
        config = Cfg.load(env={}, segment_bytes=1 << 16)

    monkeypatch.setattr(api, "_default", Running())
    assert api.init(segment_bytes=1 << 16) is api._default  # the same options: a no-op
    with pytest.raises(InvalidArgumentError, match="segment_bytes=1048576 .running: 65536"):
        api.init(segment_bytes=1 << 20)
    with pytest.raises(InvalidArgumentError, match="communicator"):
        api.init(comm=object())


def test_one_config_for_service_and_loop() -> None:
    """The engine's loop takes the service's Config itself (no copy of some fields), so
    every option, the loop's timing ones included, is set one way and checked once."""
    from conftest import local_services

    cfg = Config.load(env={"TOTALREDUCE_SPIN_S": "1e-5", "TOTALREDUCE_WAIT_SPIN_S": "0"})
    assert cfg.spin_s == 1e-5 and cfg.wait_spin_s == 0.0
    with local_services(1, spin_s=1e-5, need_after_s=0.25) as (svc,):
        assert svc.loop.cfg is svc.config
        assert svc.loop.cfg.spin_s == 1e-5 and svc.loop.cfg.need_after_s == 0.25
    for name in ("spin_s", "wait_spin_s", "need_after_s", "backoff_min_s", "stall_warning_s"):
        with pytest.raises(InvalidArgumentError, match=f"{name} must be >= 0"):
            Config.load(env={}, **{name: -1.0})
    with pytest.raises(InvalidArgumentError, match="spin_s must be >= 0"):
        Config.load(env={"TOTALREDUCE_SPIN_S": "nan"})


def test_naps_are_off_in_a_rank_and_on_in_a_node_services_engine() -> None:
    """``nap_s``: 0 (yield) by default; checked like the other times; a node's service
    gives its engine among the services its own naps unless ``TOTALREDUCE_NAP_S`` is set
    (0 there turns them off)."""
    from totalreduce.daemon.serve import SERVICE_NAP_S, engine_config

    assert Config.load(env={}).nap_s == 0.0
    assert Config.load(env={"TOTALREDUCE_NAP_S": "5e-5"}).nap_s == 5e-5
    with pytest.raises(InvalidArgumentError, match="nap_s must be >= 0"):
        Config.load(env={}, nap_s=-1.0)
    with pytest.raises(InvalidArgumentError, match="nap_s must be at most 0.01 seconds"):
        Config.load(env={"TOTALREDUCE_NAP_S": "1"})
    assert SERVICE_NAP_S > 0
    assert engine_config(Config.load(env={}), env={}).nap_s == SERVICE_NAP_S
    env = {"TOTALREDUCE_NAP_S": "0"}
    assert engine_config(Config.load(env=env), env=env).nap_s == 0.0
    env = {"TOTALREDUCE_NAP_S": "1e-4"}
    assert engine_config(Config.load(env=env), env=env).nap_s == 1e-4
    assert engine_config(Config.load(env={}), env={}).idle_backoff_max_s >= 0.25
