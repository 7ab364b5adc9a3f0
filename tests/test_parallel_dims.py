"""One mesh object per run (`ParallelDims`): engines of one layout share meshes and communicators; another
layout builds only the mesh it lacks; an engine given a mesh of another layout says so."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardrl.testing import TINY_MODELS, run_distributed

pytestmark = pytest.mark.multiproc


def _num_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _share() -> dict:
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.distributed import ParallelDims
    from shardrl.engine import build_engine

    out = {}
    dims = ParallelDims()
    full = dims.mesh_for(-1, 1)
    out["fsdp_8_is_full"] = dims.mesh_for(8, 1) is full  # >= world: the same 1-D mesh
    hsdp = dims.mesh_for(2, 1)
    out["hsdp_shares_dp_sp"] = hsdp.dp_sp_mesh is full.dp_sp_mesh and hsdp.fsdp_mesh is not full.fsdp_mesh
    sp2 = dims.mesh_for(2, 2)
    out["sp2_shares_fsdp"] = sp2.fsdp_mesh is hsdp.fsdp_mesh and sp2.dp_sp_mesh is not hsdp.dp_sp_mesh
    out["num_meshes"] = dims.num_meshes
    out["layouts"] = [(m.fsdp_size, m.sp_size, m.dp_size) for m in (full, hsdp, sp2)]

    model = ModelConfig(tiny=TINY_MODELS["qwen2"])
    actor_cfg, ref_cfg = EngineConfig(fsdp_size=2), EngineConfig(fsdp_size=2)
    actor = build_engine(model, actor_cfg, OptimConfig(lr=1e-3), mesh=dims.for_engine(actor_cfg))
    before = _num_groups()
    ref = build_engine(model, ref_cfg, None, mesh=dims.for_engine(ref_cfg))
    out["ref_new_groups"] = _num_groups() - before
    out["ref_shares_actor_mesh"] = ref.mesh is actor.mesh
    before = _num_groups()
    build_engine(model, EngineConfig(), None)  # standalone, no mesh given: builds its own
    out["standalone_new_groups"] = _num_groups() - before
    try:
        build_engine(model, EngineConfig(fsdp_size=-1), None, mesh=hsdp)
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_engines_of_one_layout_share_the_runs_meshes():
    out = run_distributed(_share, 4)
    assert out["fsdp_8_is_full"] and out["hsdp_shares_dp_sp"] and out["sp2_shares_fsdp"]
    assert out["num_meshes"] == 4  # fsdp over 4, HSDP 2x2; (dp, sp) of sp 1 and 2
    assert out["layouts"] == [(4, 1, 4), (2, 1, 4), (2, 2, 2)]
    assert out["ref_shares_actor_mesh"] and out["ref_new_groups"] == 0
    assert out["standalone_new_groups"] > 0  # what every engine used to do
    assert "fsdp_size=-1" in out["mismatch"] and "HSDP" in out["mismatch"] and "ParallelDims" in out["mismatch"]
