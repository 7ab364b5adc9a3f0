"""Helpers shared by tests and benchmarks: tiny model configs, batches, and running a function on
several local processes (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from multiprocessing import reduction

from shardrl.batch import Batch
from shardrl.models.tiny import TINY_MODELS, TINY_MOE_MODELS, TINY_VL_MODELS, tiny_config  # noqa: F401  (tests read)


def random_batch(num_seqs: int, max_len: int, vocab_size: int, seed: int = 0, min_len: int = 3,
                 prompt_len: int = 2) -> Batch:
    """Left-padded sequences of random lengths; the tokens after the first `prompt_len` are scored, each
    with a random weight (`advantages`) so a policy-gradient loss has a non-trivial gradient."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g)
    input_ids = torch.randint(1, vocab_size, (num_seqs, max_len), generator=g)
    attention_mask = torch.zeros(num_seqs, max_len, dtype=torch.long)
    loss_mask = torch.zeros(num_seqs, max_len, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        attention_mask[i, max_len - n:] = 1
        loss_mask[i, max_len - n + prompt_len:] = 1
    input_ids = input_ids * attention_mask
    advantages = torch.randn(num_seqs, max_len, generator=g) * loss_mask
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
                  "advantages": advantages})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallerFd:
    """One of the caller's file descriptors, handed to a rank as it starts: a rank forked from the fork server would
    otherwise inherit the server's (the stdout of whichever test started it), not the caller's."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled as the rank starts: multiprocessing sends the descriptor along
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_path: str,
            caller: tuple | None = None):
    if caller is not None:  # the caller's environment and stdout/stderr (a fork server's are its own)
        environ, stdout_fd, stderr_fd = caller
        os.environ.clear()
        os.environ.update(environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for received, fd in ((stdout_fd, 1), (stderr_fd, 2)):
            if received != fd:
                os.dup2(received, fd)
                os.close(received)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from shardrl.distributed import init_distributed
    import torch.distributed as dist

    init_distributed(timeout_s=300)  # a hung collective fails the test instead of stalling the run
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# What a rank of `run_distributed` imports anyway, imported once into a fork server: a rank forked from it starts in
# a tenth of a second instead of the ~3-4 s a fresh interpreter takes to import torch, transformers and the engine
# (a test suite of tiny models spends much of its time there). Nothing here touches CUDA, so a forked rank can.
FORK_SERVER_PRELOAD = ["shardrl.testing", "shardrl.engine.build", "transformers"]


def run_distributed(fn: Callable, world_size: int, *args) -> Any:
    """Runs `fn(*args)` on `world_size` local processes; returns what rank 0's call returned. Each process starts
    with this process's environment variables as they are now and writes to its stdout and stderr, as a process
    spawned from here would."""
    methods = mp.get_all_start_methods()
    method = "forkserver" if "forkserver" in methods else "spawn"
    if method == "forkserver":
        mp.get_context(method).set_forkserver_preload(FORK_SERVER_PRELOAD)  # no effect once the server runs
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "result.pt")
        caller = (dict(os.environ), _CallerFd(1), _CallerFd(2))
        mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, out_path, caller),
                           nprocs=world_size, join=True, start_method=method)
        return torch.load(out_path, weights_only=False)


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (HF names, fp32, on the CPU) as it is now; every rank must call it
    (the gathers are collectives)."""
    from torch.distributed.tensor import DTensor

    if engine.strategy == "fsdp":  # FSDP1 (`use_orig_params`): a rank holds a flat shard; unshard with grads
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(engine.module, writeback=False, with_grads=True):
            return {engine.hf_name(n): p.grad.detach().float().cpu().clone()
                    for n, p in engine.module.named_parameters() if p.grad is not None}
    out = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[engine.hf_name(name)] = g.detach().float().cpu().clone()
    return out


def record_grads(engine) -> list[dict[str, torch.Tensor]]:
    """Makes `engine` record the whole gradients its optimizer steps on (after any clipping), one dict per
    step, in the list it returns: tests compare gradients, which one AdamW step (about lr * sign(g)) hides."""
    steps: list[dict[str, torch.Tensor]] = []
    engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: steps.append(full_grads(engine)))
    return steps


def save_char_model(folder: Path, seed: int = 0, **shape):
    """A tiny random Qwen2 causal LM with the character tokenizer, saved as a model folder (64 wide, 2 layers
    unless `shape` says otherwise); returns the tokenizer."""
    from shardrl.tokenizer import build_char_tokenizer

    return _save_qwen2(folder, build_char_tokenizer(), seed, shape)


def _save_qwen2(folder: Path, tok, seed: int, shape: dict):
    """A tiny random Qwen2 causal LM over `tok`'s ids (64 wide, 2 layers unless `shape` says otherwise) and `tok`,
    saved as a model folder; returns `tok`."""
    import transformers

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) | shape
    config = transformers.AutoConfig.for_model("qwen2", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                               eos_token_id=tok.eos_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def interrupt_after_first_step(argv: list[str], run_dir: Path, stderr_path: Path, timeout_s: float = 300,
                               sigterm: bool = False) -> int:
    """Runs `python -m shardrl.cli *argv` in a session of its own, sends its process group SIGINT (what a terminal's
    Ctrl-C reaches: the launcher and its ranks) once `run_dir/metrics.jsonl` holds a step, and returns the exit
    status; stderr goes to `stderr_path`. `sigterm`: SIGTERM to the launcher's process alone instead (what
    `timeout`, `kill` and a scheduler send)."""
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "shardrl.cli", *argv], stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True, env=env)
        try:
            metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout_s
            while not (metrics.is_file() and metrics.read_text().strip()):
                assert proc.poll() is None, stderr_path.read_text()[-3000:]
                assert time.time() < deadline, f"no step within {timeout_s} s"
                time.sleep(0.05)
            if sigterm:
                os.kill(proc.pid, signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGINT)
            return proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def small_demo_run(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    """Overrides for a small run of the built-in demo (4 prompts x 4 responses a step, no validation, no model
    export) into `run_dir`; `extra` overrides follow and win."""
    from shardrl.trainer.demo import demo_overrides

    return demo_overrides(assets) + [
        f"trainer.output_dir={run_dir}", "trainer.val_freq=0", "trainer.export_hf=false", "data.train_batch_size=4",
        "rollout.n=4", "actor.ppo_mini_batch_size=2", *extra]


def random_vl_batch(hf_config, rows: list[tuple[int, list[tuple[int, int, int]], int]], seed: int = 0) -> Batch:
    """An RL batch of a vision-language model (`shardrl.models.vision`): per row (text tokens before the images,
    the images' (t, h, w) patch grids, response tokens). A row's prompt is its text then each image as
    <vision_start> placeholders <vision_end>, left-padded; its response is right-padded. Random pixel values per
    patch; `multi_modal_inputs` holds each row's (`shardrl.engine.vision`), `advantages` random on the response."""
    g = torch.Generator().manual_seed(seed)
    vision = hf_config.vision_config
    merge, patch_dim = vision.spatial_merge_size, 3 * vision.temporal_patch_size * vision.patch_size ** 2
    image, start, end = hf_config.image_token_id, hf_config.vision_start_token_id, hf_config.vision_end_token_id
    vocab = min(image, start, end)  # text tokens below the special ones (and above pad/bos/eos)
    prompts, responses, images = [], [], []
    for num_text, grids, num_response in rows:
        ids = torch.randint(3, vocab, (num_text,), generator=g).tolist()
        for t, h, w in grids:
            ids += [start] + [image] * (t * h * w // merge ** 2) + [end]
        prompts.append(ids)
        responses.append(torch.randint(3, vocab, (num_response,), generator=g).tolist())
        images.append({"pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=g),
                       "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3)} if grids else None)
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(len(rows), width_p + width_r, dtype=torch.long)
    attention_mask, response_mask = torch.zeros_like(input_ids), torch.zeros(len(rows), width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, width_p - len(p):width_p], input_ids[i, width_p:width_p + len(r)] = torch.tensor(p), torch.tensor(r)
        attention_mask[i, width_p - len(p):width_p + len(r)] = 1
        response_mask[i, :len(r)] = 1
    loss_mask = torch.cat([torch.zeros(len(rows), width_p, dtype=torch.long), response_mask], 1)
    advantages = torch.randn(input_ids.shape, generator=g) * loss_mask
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
                  "loss_mask": loss_mask, "advantages": advantages}, {"multi_modal_inputs": images})


VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def tiny_vl_processor(hf_config, patch_size: int | None = None):
    """A Qwen2.5-VL processor for a tiny VL config (`TINY_VL_MODELS`): the character tokenizer with the vision
    tokens added at the config's ids, a chat template that renders image parts, and Qwen2-VL's PIL image
    processor at the config's patch and merge sizes (min_pixels one merged patch, max_pixels 16 of them)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from shardrl.data.images import image_only_processor
    from shardrl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    special = {hf_config.vision_start_token_id: "<|vision_start|>", hf_config.image_token_id: "<|image_pad|>",
               hf_config.vision_end_token_id: "<|vision_end|>", hf_config.video_token_id: "<|video_pad|>"}
    filler = [f"<|unused_{i}|>" for i in range(len(tok), min(special))]  # the ids between the alphabet and these
    tok.add_special_tokens({"additional_special_tokens": filler + [special[i] for i in sorted(special)]})
    assert all(tok.convert_tokens_to_ids(t) == i for i, t in special.items())
    tok.chat_template = VL_CHAT_TEMPLATE
    vision = hf_config.vision_config
    patch, merge = patch_size or vision.patch_size, vision.spatial_merge_size
    unit = (patch * merge) ** 2
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, temporal_patch_size=vision.temporal_patch_size,
                                      size={"shortest_edge": unit, "longest_edge": 16 * unit})

    return image_only_processor(images, tok)


def save_tiny_vl_model(folder: Path, kind: str = "qwen2_5_vl", seed: int = 0, **text_shape):
    """A tiny random vision-language model (`TINY_VL_MODELS`, its decoder reshaped by `text_shape`) saved as a
    model folder with its processor's parts (`tiny_vl_processor`: the tokenizer with its chat template and the
    image processor, which `shardrl.data.images.load_processor` reads back); returns the processor."""
    import transformers

    from shardrl.engine.model import load_hf_config

    kwargs = dict(tiny_config(kind))
    kwargs["text_config"] = {**kwargs["text_config"], **text_shape}
    kwargs["vision_config"] = {**kwargs["vision_config"], "out_hidden_size": kwargs["text_config"]["hidden_size"]}
    config = load_hf_config(None, kwargs)
    processor = tiny_vl_processor(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    return processor


BYTE_TEXT = ("hello world, hello there. the cat sat on the mat; the dog ran to the park. 1 + 2 = 3, 2 + 2 = 4. "
             "café, naïve, 世界, 🙂.")
"""What `save_byte_model`'s tokenizer is trained on."""
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A Qwen-like (ChatML) template: tools rendered into a system turn, each message between <|im_start|> and
<|im_end|>, which are special tokens."""


def save_byte_model(folder: Path, seed: int = 0, **shape):
    """A tiny random Qwen2 causal LM with a byte-level BPE tokenizer (GPT-2's and Qwen's kind: a vocabulary entry
    spells bytes as characters, a space as 'Ġ'; a character of several bytes may be split across tokens) and
    `BYTE_CHAT_TEMPLATE`, saved as a model folder; returns the tokenizer."""
    import tokenizers
    import transformers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([BYTE_TEXT] * 4, vocab_size=300, min_frequency=2, special_tokens=specials,
                            show_progress=False)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", chat_template=BYTE_CHAT_TEMPLATE,
                                               padding_side="left", clean_up_tokenization_spaces=False,
                                               model_max_length=512)
    return _save_qwen2(folder, tok, seed, dict(max_position_embeddings=512) | shape)
