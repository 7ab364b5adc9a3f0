"""The device-mesh layout: which layouts a world can hold, and the meshes and groups built for them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardrl.distributed import all_reduce_sum, build_device_mesh, check_layout
from shardrl.testing import run_distributed


@pytest.mark.parametrize("world, fsdp, sp", [(1, -1, 1), (4, -1, 4), (4, 2, 2), (8, 4, 2), (4, 8, 1), (6, 3, 1)])
def test_check_layout_accepts(world, fsdp, sp):
    check_layout(world, fsdp, sp)


def test_check_layout_sp_must_divide_world():
    with pytest.raises(ValueError) as e:
        check_layout(6, -1, 4)
    msg = str(e.value)
    assert "ulysses_sequence_parallel_size=4" in msg and "world size 6" in msg
    assert "[1, 2, 3, 6]" in msg
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=0 .* choose one of \[1, 2, 4, 8\]"):
        check_layout(8, -1, 0)


def test_check_layout_fsdp_must_divide_world():
    with pytest.raises(ValueError) as e:
        check_layout(12, 5, 1)
    msg = str(e.value)
    assert "fsdp_size=5" in msg and "world size 12" in msg
    assert "[1, 2, 3, 4, 6, 12]" in msg and "-1" in msg


@pytest.mark.parametrize("fsdp", [0, -2])
def test_check_layout_fsdp_invalid(fsdp):
    with pytest.raises(ValueError) as e:
        check_layout(4, fsdp, 1)
    msg = str(e.value)
    assert f"fsdp_size={fsdp} is invalid" in msg and "-1" in msg and "positive" in msg


def _meshes() -> dict:
    rank = dist.get_rank()
    out = {}

    full = build_device_mesh(-1, 1)
    out["full"] = dict(names=full.fsdp_mesh.mesh_dim_names, shape=tuple(full.fsdp_mesh.shape),
                       dp=full.dp_size, sp=full.sp_size, dp_rank=full.dp_rank, hsdp=full.is_hsdp,
                       describe=full.describe())

    hsdp = build_device_mesh(2, 1)
    out["hsdp"] = dict(names=hsdp.fsdp_mesh.mesh_dim_names, shape=tuple(hsdp.fsdp_mesh.shape),
                       dp=hsdp.dp_size, hsdp=hsdp.is_hsdp,
                       fsdp_peers=dist.get_process_group_ranks(hsdp.fsdp_mesh.get_group("fsdp")),
                       ddp_peers=dist.get_process_group_ranks(hsdp.fsdp_mesh.get_group("ddp")))

    # what FSDP1 is handed: a shard group of one rank would make it skip the replica broadcast and all-reduce
    from shardrl.engine.fsdp1 import fsdp1_sharding

    replicas = build_device_mesh(1, 1)
    out["fsdp1"] = {}
    for name, layout in (("full", full), ("hsdp", hsdp), ("replicas", replicas)):
        for reshard in (True, False):
            mesh, strategy = fsdp1_sharding(layout.fsdp_mesh, reshard)
            out["fsdp1"][name, reshard] = (strategy.name, dist.get_process_group_ranks(mesh.get_group(0)), mesh.ndim)

    sp = build_device_mesh(-1, 2)
    out["sp"] = dict(dp=sp.dp_size, sp=sp.sp_size, dp_rank=sp.dp_rank,
                     sp_rank=sp.sp_rank,
                     dp_peers=dist.get_process_group_ranks(sp.dp_group),
                     sp_peers=dist.get_process_group_ranks(sp.sp_group))
    # ranks r and r+2 see different data: sum over the dp group of {1, 2, 3, 4}
    out["sum_float"] = all_reduce_sum(torch.tensor([rank + 1.0, 0.5], dtype=torch.float32), sp.dp_group)
    out["sum_int"] = all_reduce_sum(torch.tensor([10 * (rank + 1)]), sp.dp_group)
    out["sum_world"] = all_reduce_sum(torch.tensor([float(rank)]), full.dp_group)
    x = torch.tensor([3.0])
    same = all_reduce_sum(x, None)
    out["none_is_copy"] = bool(torch.equal(same, x)) and same.data_ptr() != x.data_ptr()

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.mark.multiproc
def test_meshes_on_four_ranks():
    per_rank = run_distributed(_meshes, 4)
    for rank, out in enumerate(per_rank):
        full = out["full"]
        assert full["names"] == ("fsdp",) and full["shape"] == (4,)
        assert (full["dp"], full["sp"], full["dp_rank"], full["hsdp"]) == (4, 1, rank, False)
        assert full["describe"] == "FSDP mesh {'fsdp': 4}, dp=4, sp=1"

        hsdp = out["hsdp"]
        assert hsdp["names"] == ("ddp", "fsdp") and hsdp["shape"] == (2, 2)
        assert hsdp["hsdp"] and hsdp["dp"] == 4
        assert hsdp["fsdp_peers"] == ([0, 1] if rank < 2 else [2, 3])  # shard within a replica
        assert hsdp["ddp_peers"] == [rank % 2, rank % 2 + 2]  # replicate across replicas

        fsdp1, pair = out["fsdp1"], [rank % 2, rank % 2 + 2]
        assert fsdp1["full", True] == ("FULL_SHARD", [0, 1, 2, 3], 1)
        assert fsdp1["full", False] == ("SHARD_GRAD_OP", [0, 1, 2, 3], 1)
        assert fsdp1["hsdp", True] == ("HYBRID_SHARD", pair, 2)  # group 0 of the 2-D mesh: the replicas
        assert fsdp1["hsdp", False] == ("_HYBRID_SHARD_ZERO2", pair, 2)
        assert fsdp1["replicas", True] == fsdp1["replicas", False] == ("NO_SHARD", [0, 1, 2, 3], 1)

        sp = out["sp"]
        assert (sp["dp"], sp["sp"]) == (2, 2)
        assert sp["dp_rank"] == rank // 2 and sp["sp_rank"] == rank % 2
        assert sp["dp_peers"] == [rank % 2, rank % 2 + 2]
        assert sp["sp_peers"] == [rank - rank % 2, rank - rank % 2 + 1]

        expected = (rank % 2 + 1) + (rank % 2 + 3)  # 4 on ranks 0, 2; 6 on ranks 1, 3
        assert out["sum_float"].dtype == torch.float32
        assert out["sum_float"].tolist() == [float(expected), 1.0]
        assert out["sum_int"].dtype == torch.int64 and out["sum_int"].tolist() == [10 * expected]
        assert out["sum_world"].tolist() == [6.0]
        assert out["none_is_copy"]
