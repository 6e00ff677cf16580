"""PyTorch integration: tensors, optimizers, DDP hooks and layers on the totalreduce engine.

Optional: ``import totalreduce`` never imports torch; ``import totalreduce.torch``
does, and raises an ImportError saying what to install when torch is missing.

- Tensors (``collectives.py``): :func:`allreduce_async` and friends take CPU
  tensors of float32, float64, float16, bfloat16, int32 and int64 without a copy
  when they are contiguous; CUDA tensors travel through a pinned host buffer.
  Each op's forms are built from its record in :mod:`totalreduce.ops_table`.
- :func:`DistributedOptimizer` (``optimizer.py``): Horovod's optimizer wrapper;
  gradients travel in fusion buckets (``buckets.py``), each submitted the moment
  its last gradient is ready; CUDA buckets are staged on a side stream
  (``cuda_staging.py``); ``join()`` for uneven inputs.
- :func:`broadcast_parameters`, :func:`broadcast_optimizer_state`,
  :func:`broadcast_object`, :func:`allgather_object` (``broadcast_state.py``).
- Horovod's names where the meanings match: :func:`local_rank`,
  :func:`local_size`, :func:`cross_rank`, :func:`cross_size`, ``root_rank=``,
  :data:`Average` / :data:`Sum` / :data:`Min` / :data:`Max`,
  :class:`Compression` (``compression.py``), :func:`barrier`.
- :func:`allreduce_hook`, :func:`fp16_compress_hook`, :func:`bfloat16_compress_hook`
  (``comm_hooks.py``): comm hooks for ``DistributedDataParallel``.
- :class:`DecentralizedDataParallel` (``decentralized.py``): neighbor averaging
  of parameters after every step, Decent-DP style; Decent-DP's own API, where a
  Decent-DP script runs by changing its imports, is :mod:`totalreduce.torch.decent_dp`.
- :class:`ReduceScatter` and :class:`AllGather` (``layers.py``): ``nn.Module``\\ s,
  each the other's adjoint.
- The ``"totalreduce"`` backend of ``torch.distributed`` (``process_group.py``),
  registered by this import: ``dist.init_process_group("totalreduce",
  init_method="totalreduce://")`` under ``mpiexec``, then unchanged DDP.
- ``python -m totalreduce.torch.bench`` (``bench.py``, ``resnet.py``): ResNet
  training with the optimizer, DDP over gloo and DDP over this backend.

Example::

    import totalreduce.torch as trt

    trt.init()
    trt.broadcast_parameters(model.state_dict(), root=0)
    opt = trt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # gradients leave as soon as they are ready
        opt.step()                        # waits for the averaged gradients, then steps
"""

from __future__ import annotations

try:
    import torch as _torch
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "totalreduce.torch needs PyTorch. A CPU-only build is enough: pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu (plain 'pip install torch' also "
        "works but brings the CUDA libraries)"
    ) from _exc
if not hasattr(_torch, "Tensor"):  # a directory named torch on sys.path, not the package
    raise ImportError(
        f"totalreduce.torch needs PyTorch, but 'torch' resolved to {_torch!r}, which is not "
        "PyTorch: pip install torch"
    )

from ..api import (
    cross_rank,
    cross_size,
    default_service,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from ..launch import provide_torchrun_env as _provide_torchrun_env
from ..topology import (  # noqa: F401 (bluefog.torch's re-exports of topology_util)
    ExponentialGraph,
    ExponentialTwoGraph,
    FullyConnectedGraph,
    GetDynamicOnePeerSendRecvRanks,
    GetExp2DynamicSendRecvMachineRanks,
    GetInnerOuterExpo2DynamicSendRecvRanks,
    GetInnerOuterRingDynamicSendRecvRanks,
    GetRecvWeights,
    GetSendWeights,
    IsRegularGraph,
    IsTopologyEquivalent,
    MeshGrid2DGraph,
    RingGraph,
    StarGraph,
    SymmetricExponentialGraph,
)
from . import decent_dp  # noqa: F401 (Decent-DP's API: trt.decent_dp.DecentralizedDataParallel)
from . import windows as _windows
from .bluefog import (
    in_neighbor_machine_ranks,
    in_neighbor_ranks,
    is_machine_topo_weighted,
    is_topo_weighted,
    load_machine_topology,
    load_topology,
    machine_rank,
    machine_size,
    out_neighbor_machine_ranks,
    out_neighbor_ranks,
    set_machine_topology,
    set_topology,
)
from .bluefog_ops import (
    InferDestinationFromSourceRanks,
    InferSourceFromDestinationRanks,
    allreduce_parameters,
    get_current_created_window_names,
    get_skip_negotiate_stage,
    hierarchical_neighbor_allreduce,
    hierarchical_neighbor_allreduce_nonblocking,
    neighbor_allgather,
    neighbor_allgather_nonblocking,
    neighbor_win_accumulate,
    neighbor_win_accumulate_nonblocking,
    neighbor_win_get,
    neighbor_win_get_nonblocking,
    neighbor_win_put,
    neighbor_win_put_nonblocking,
    resume,
    set_skip_negotiate_stage,
    suspend,
    timeline_context,
    timeline_end_activity,
    timeline_start_activity,
    unified_mpi_window_model_supported,
)
from .bluefog_optimizers import (
    CommunicationType,
    DistributedAdaptThenCombineOptimizer,
    DistributedAdaptWithCombineOptimizer,
    DistributedAllreduceOptimizer,
    DistributedGradientAllreduceOptimizer,
    DistributedHierarchicalNeighborAllreduceOptimizer,
    DistributedNeighborAllreduceOptimizer,
)
from .broadcast_state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Sum,
    allgather,
    allgather_async,
    allgather_nonblocking,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    allreduce_nonblocking,
    allreduce_nonblocking_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_nonblocking,
    broadcast_nonblocking_,
    neighbor_allreduce,
    neighbor_allreduce_,
    neighbor_allreduce_async,
    neighbor_allreduce_async_,
    neighbor_allreduce_nonblocking,
    poll,
    reduce_scatter,
    reduce_scatter_async,
    synchronize,
    wait,
)
from .comm_hooks import CommHookState, allreduce_hook, bfloat16_compress_hook, fp16_compress_hook
from .compression import Compression
from .decentralized import DecentralizedDataParallel
from .horovod import (
    GroupHandle,
    alltoall,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    grouped_allreduce_async,
    is_homogeneous,
    join,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    reducescatter,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from .layers import AllGather, ReduceScatter
from .optimizer import DistributedOptimizer, GradientSyncError
from .tensors import SUPPORTED_DTYPES, TensorHandle, empty
from .windows import *  # noqa: F403 (the window ops: torch/windows.py's __all__)

# Under mpiexec, torchrun-style scripts read RANK, LOCAL_RANK and WORLD_SIZE before they
# initialise anything: the MPI launcher's placement provides them (never overwritten).
_provide_torchrun_env()

if _torch.distributed.is_available():
    from .process_group import TotalReduceProcessGroup, UnsupportedOpError
    from .process_group import register as _register_backend

    _register_backend()
    from .launching import install as _install_env_over_mpi

    _install_env_over_mpi()

__all__ = [
    "GroupHandle",
    "empty",
    "alltoall",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "join",
    "reducescatter",
    "in_neighbor_ranks",
    "is_topo_weighted",
    "load_topology",
    "out_neighbor_ranks",
    "set_topology",
    "SUPPORTED_DTYPES",
    "AllGather",
    "Adasum",
    "Average",
    "CommHookState",
    "Compression",
    "DecentralizedDataParallel",
    "DistributedOptimizer",
    "GradientSyncError",
    "Max",
    "Min",
    "ReduceScatter",
    "Sum",
    "TensorHandle",
    "TotalReduceProcessGroup",
    "UnsupportedOpError",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "allreduce_hook",
    "barrier",
    "bfloat16_compress_hook",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "default_service",
    "fp16_compress_hook",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "neighbor_allreduce",
    "neighbor_allreduce_",
    "neighbor_allreduce_async",
    "neighbor_allreduce_async_",
    "poll",
    "rank",
    "reduce_scatter",
    "reduce_scatter_async",
    "shutdown",
    "size",
    "synchronize",
    "ccl_built",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "is_homogeneous",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "allgather_nonblocking",
    "allreduce_nonblocking",
    "allreduce_nonblocking_",
    "broadcast_nonblocking",
    "broadcast_nonblocking_",
    "machine_rank",
    "machine_size",
    "neighbor_allreduce_nonblocking",
    "wait",
]
__all__ += _windows.__all__
# BlueFog's names (bluefog.py, bluefog_ops.py).  bluefog.torch's re-exports of topology_util
# (bf.RingGraph, bf.GetRecvWeights, ...) are attributes here too, documented in
# totalreduce.topology.
__all__ += [
    "CommunicationType",
    "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer",
    "DistributedAllreduceOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "InferDestinationFromSourceRanks",
    "InferSourceFromDestinationRanks",
    "allreduce_parameters",
    "get_current_created_window_names",
    "get_skip_negotiate_stage",
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_nonblocking",
    "in_neighbor_machine_ranks",
    "is_machine_topo_weighted",
    "load_machine_topology",
    "neighbor_allgather",
    "neighbor_allgather_nonblocking",
    "neighbor_win_accumulate",
    "neighbor_win_accumulate_nonblocking",
    "neighbor_win_get",
    "neighbor_win_get_nonblocking",
    "neighbor_win_put",
    "neighbor_win_put_nonblocking",
    "out_neighbor_machine_ranks",
    "resume",
    "set_machine_topology",
    "set_skip_negotiate_stage",
    "suspend",
    "timeline_context",
    "timeline_end_activity",
    "timeline_start_activity",
    "unified_mpi_window_model_supported",
]
