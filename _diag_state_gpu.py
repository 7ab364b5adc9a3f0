import faulthandler, sys, time, os, importlib
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
import torch
T0 = time.time()
def log(*a):
    print(f"[{time.time()-T0:6.1f}s r{os.environ.get('RANK')}]", *a, flush=True)

def patched(module_name, fn_name, *args):
    faulthandler.dump_traceback_later(60, exit=True)
    import shardrl.engine.fsdp1 as f1
    orig = f1.FSDP1Engine._wrap
    def _wrap(self, module, full):
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return orig(self, module, full)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    f1.FSDP1Engine._wrap = _wrap
    out = getattr(importlib.import_module(module_name), fn_name)(*args)
    faulthandler.cancel_dump_traceback_later()
    return out

if __name__ == "__main__":
    from shardrl.testing import run_distributed
    import test_engine_state as t, transformers
    from shardrl.testing import TINY_MODELS, random_batch
    tmp = "/tmp/diag_hf"
    try:
        res = run_distributed(patched, 2, "test_engine_state", "gpu_fsdp1_export_worker", tmp)
        want = dict(t.reference_model("llama").named_parameters())
        log("keys equal", res["init"].keys() == want.keys(), "values equal", all(torch.equal(res["init"][k], w.detach()) for k, w in want.items()))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp + "/hf", dtype=torch.float32)
        batch = random_batch(t.NUM_SEQS, t.MAX_LEN, 101, seed=t.INFER_SEED)
        log("logprob diff", (t.hf_log_probs(model, batch) - res["log_probs"].cpu()).abs().max().item())
    except Exception as e:
        log("FAILED export", type(e).__name__, e)
    import pytest
    log("checkpoint test")
    rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--durations=3", "--timeout=240", "tests/test_checkpoint.py", "-m", "cuda"])
    log("rc", rc)
