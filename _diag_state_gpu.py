import faulthandler, sys, time, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
import torch
T0 = time.time()
def log(*a):
    print(f"[{time.time()-T0:6.1f}s r{os.environ.get('RANK')}]", *a, flush=True)

def diag(kind, warm):
    faulthandler.dump_traceback_later(45, exit=True)
    import test_engine_state as t
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    engine = t.make_engine(kind, strategy="fsdp")
    lm = engine.module.lm
    log(kind, "tied", lm.lm_head.weight is lm.model.embed_tokens.weight,
        [(type(u.module).__name__, u._handle.flat_param._unpadded_unsharded_size if u._handle else None) for u in FSDP.fsdp_modules(engine.module)])
    if warm:
        engine.infer_batch(t.rank_batch(engine, 101, 1))
        log("infer ok")
    w = t.cpu_weights(engine)
    log("export ok", len(w))
    faulthandler.cancel_dump_traceback_later()
    return len(w)

if __name__ == "__main__":
    from shardrl.testing import run_distributed
    for kind, warm in (("qwen2", False), ("llama", True), ("llama", False)):
        try:
            log(kind, warm, run_distributed(diag, 2, kind, warm))
        except Exception as e:
            log("FAILED", kind, warm, type(e).__name__)
