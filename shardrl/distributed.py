"""Process group start-up and the device mesh every engine shards on.

Layout rules (docs/design.md):
- `fsdp_size` -1 or >= world: a 1-D `("fsdp",)` mesh, parameters fully sharded over all ranks.
- `fsdp_size` < world: a 2-D `("ddp", "fsdp")` mesh (HSDP): sharded within groups of `fsdp_size`,
  replicated across the `world // fsdp_size` groups.
- Ulysses sequence parallel of size `sp` adds a `("dp", "sp")` view; the data-parallel size is
  `world // sp` (ranks of one sp group hold pieces of the same sequences).
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Starts the default process group from torchrun's environment (a world of 1 without it)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    # On GPUs every group gets a gloo half too: FSDP's CPU offload keeps gradients (and so the pieces of
    # the gradient norm) on the CPU, and NCCL cannot reduce CPU tensors. Collectives pick the backend by
    # the tensor's device, so device tensors still go through NCCL.
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # one process, no launcher; set no RANK/MASTER_* variables a child process could inherit
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class MeshLayout:
    """The meshes of one engine and the sizes derived from them."""

    fsdp_mesh: DeviceMesh
    """1-D ("fsdp",) or 2-D ("ddp", "fsdp"): what parameters are sharded/replicated on."""
    dp_sp_mesh: DeviceMesh
    """2-D ("dp", "sp"): which ranks see the same data (sp) and which see different data (dp)."""
    world_size: int
    sp_size: int
    _expert_meshes: dict = field(default_factory=dict, repr=False)

    def expert_mesh(self, ep: int) -> DeviceMesh:
        """2-D ("efsdp", "ep") over the world, for expert parallelism of size `ep`: the `ep` consecutive ranks of a
        row hold different experts (one node's GPUs where they fit: the all-to-alls stay on its links), the
        world // ep ranks of a column the same ones, sharded over them. Built on first use, once per size."""
        if ep not in self._expert_meshes:
            self._expert_meshes[ep] = init_device_mesh(device_type(), (self.world_size // ep, ep),
                                                       mesh_dim_names=("efsdp", "ep"))
        return self._expert_meshes[ep]

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.dp_sp_mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        return self.dp_sp_mesh.get_local_rank("sp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_sp_mesh.get_group("dp")

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.dp_sp_mesh.get_group("sp")

    @property
    def is_hsdp(self) -> bool:
        return self.fsdp_mesh.ndim == 2

    @property
    def fsdp_size(self) -> int:
        """Ranks one parameter is sharded over."""
        return self.fsdp_mesh.size(self.fsdp_mesh.ndim - 1)

    def check_matches(self, fsdp_size: int, sp_size: int, who: str = "engine") -> None:
        """Raises ValueError when this mesh is not the layout a config asks for."""
        want = self.world_size if fsdp_size == -1 or fsdp_size >= self.world_size else fsdp_size
        if (want, sp_size) != (self.fsdp_size, self.sp_size):
            raise ValueError(f"{who}: fsdp_size={fsdp_size}, ulysses_sequence_parallel_size={sp_size} asked for, "
                             f"but the mesh given is {self.describe()}; get it from ParallelDims.for_engine(its config)")

    def describe(self) -> str:
        names = self.fsdp_mesh.mesh_dim_names
        shape = tuple(self.fsdp_mesh.shape)
        kind = "HSDP" if self.is_hsdp else "FSDP"
        return f"{kind} mesh {dict(zip(names, shape))}, dp={self.dp_size}, sp={self.sp_size}"


def check_layout(world_size: int, fsdp_size: int, sp_size: int) -> None:
    """Raises ValueError, naming the numbers and a fix, for a layout the world cannot hold."""
    if sp_size < 1 or world_size % sp_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp_size} does not divide the world size {world_size}; "
            f"choose one of {divisors}"
        )
    if fsdp_size == 0 or fsdp_size < -1:
        raise ValueError(f"fsdp_size={fsdp_size} is invalid; use -1 (shard over all ranks) or a positive size")
    if 0 < fsdp_size < world_size and world_size % fsdp_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"fsdp_size={fsdp_size} does not divide the world size {world_size} (HSDP needs "
            f"world = replicas x fsdp_size); choose one of {divisors}, or -1 for full sharding"
        )


def build_device_mesh(fsdp_size: int = -1, sp_size: int = 1, world_size: int | None = None) -> MeshLayout:
    """New meshes for one layout; a run builds them once, through `ParallelDims`."""
    return ParallelDims(world_size).mesh_for(fsdp_size, sp_size)


class ParallelDims:
    """The run's device meshes, built once and shared (torchtitan's `ParallelDims`): every engine and the
    trainer ask it for the meshes of their layout instead of building their own.

    A layout is (`fsdp_size`, `sp_size`). Engines of one layout (an actor and its reference) get the same
    `MeshLayout` object, so the same communicators; an engine of another layout (a critic with another
    `fsdp_size`) gets a second fsdp mesh but shares the `("dp", "sp")` mesh of its `sp_size`. A 1-D fsdp
    mesh is the same whatever `fsdp_size` >= world was asked for.
    """

    def __init__(self, world_size: int | None = None):
        self.world_size = world_size or dist.get_world_size()
        self._fsdp_meshes: dict[int, DeviceMesh] = {}
        self._dp_sp_meshes: dict[int, DeviceMesh] = {}
        self._layouts: dict[tuple[int, int], MeshLayout] = {}

    @classmethod
    def from_config(cls, cfg) -> "ParallelDims":
        """The run's meshes, with the actor's layout built now (the others on first use)."""
        dims = cls()
        dims.for_engine(cfg.actor.engine)
        return dims

    def for_engine(self, engine_cfg) -> MeshLayout:
        """The layout an engine config asks for (`fsdp_size`, `ulysses_sequence_parallel_size`)."""
        return self.mesh_for(engine_cfg.fsdp_size, engine_cfg.ulysses_sequence_parallel_size)

    def mesh_for(self, fsdp_size: int = -1, sp_size: int = 1) -> MeshLayout:
        check_layout(self.world_size, fsdp_size, sp_size)
        shard = -1 if fsdp_size == -1 or fsdp_size >= self.world_size else fsdp_size
        key = (shard, sp_size)
        if key not in self._layouts:
            if shard not in self._fsdp_meshes:
                self._fsdp_meshes[shard] = _fsdp_mesh(shard, self.world_size)
            if sp_size not in self._dp_sp_meshes:
                self._dp_sp_meshes[sp_size] = _dp_sp_mesh(sp_size, self.world_size)
            self._layouts[key] = MeshLayout(fsdp_mesh=self._fsdp_meshes[shard], dp_sp_mesh=self._dp_sp_meshes[sp_size],
                                            world_size=self.world_size, sp_size=sp_size)
        return self._layouts[key]

    @property
    def num_meshes(self) -> int:
        """Device meshes built so far (each holds its own process groups)."""
        return len(self._fsdp_meshes) + len(self._dp_sp_meshes)


def _fsdp_mesh(fsdp_size: int, world_size: int) -> DeviceMesh:
    if fsdp_size == -1 or fsdp_size >= world_size:
        return init_device_mesh(device_type(), (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device_type(), (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def _dp_sp_mesh(sp_size: int, world_size: int) -> DeviceMesh:
    return init_device_mesh(device_type(), (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor should live for a collective on `group`: the GPU when the group has NCCL
    (alone or beside gloo), else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over `group`; returns a new tensor on the caller's device."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values.clone()
    coll_dev = collective_device(group)
    out = values.detach().to(coll_dev, dtype=torch.float64 if values.is_floating_point() else values.dtype)
    dist.all_reduce(out, group=group)
    return out.to(values.device, values.dtype)


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Each rank's `values` (the same length on every rank), in group rank order; one rank alone: [values]."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [list(values)]
    device = collective_device(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [g.tolist() for g in gathered]


def exchange_objects(outgoing: list, group: dist.ProcessGroup | None) -> list:
    """All-to-all of picklable objects over `group`: `outgoing[r]` goes to the group's rank r; returns what each
    rank sent to this one (`[from rank 0, from rank 1, ...]`, this rank's own kept as it is). The objects travel
    pickled in CPU tensors (through gloo where the group has NCCL too), point to point: each reaches only its
    destination."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(outgoing)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if len(outgoing) != world:
        raise ValueError(f"exchange_objects needs one object per rank of the group ({world}), got {len(outgoing)}")
    payloads = [torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) for obj in outgoing]
    sizes = all_gather_ints([p.numel() for p in payloads], group)  # sizes[src][dst]
    buffers, works = {}, []
    for r in range(world):
        if r == me:
            continue
        peer = r if group is None else dist.get_global_rank(group, r)
        buffers[r] = torch.empty(sizes[r][me], dtype=torch.uint8)
        works.append(dist.irecv(buffers[r], src=peer, group=group))
        works.append(dist.isend(payloads[r], dst=peer, group=group))
    for work in works:
        work.wait()
    return [outgoing[r] if r == me else pickle.loads(buffers[r].numpy().tobytes()) for r in range(world)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
