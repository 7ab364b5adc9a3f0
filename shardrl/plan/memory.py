"""Peak GPU memory per phase of an RL step, predicted from the model config and the run config (`shardrl
plan`): what PyTorch's allocator holds at most (`torch.cuda.max_memory_allocated`, the trainer's
`memory/<phase>_peak_gib`), not nvidia-smi's figure (which adds the allocator's cache and CUDA's context).

The phases are the trainer's: `gen` (weight sync + generation), `prep` (rewards, inference passes,
advantages), `update` (critic and actor updates). Each is the memory held all step long (`resident`: sharded
master weights and optimizer state, the rollout's bf16 copy of the weights, reference and critic models)
plus that phase's own terms. Every term carries the arithmetic behind it.

Activations are counted per token and layer as what autograd keeps for the backward of a Llama/Qwen-style
decoder layer with FlashAttention-style attention (bf16 compute): each RMSNorm keeps its fp32 input and its
normalized output; attention keeps q and k after rotary, v, its output and o_proj's input; a gated MLP keeps
gate, up, the activation and the product (an ungated one: its two). Checkpointing keeps only each layer's
input, plus one layer's full set during its recomputation.
A compiled layer (`engine.compile`, resolved as the run would on CUDA) keeps fewer: its norms' fp32 inputs,
o_proj's input and one of its MLP's four hidden-width tensors are recomputed in the backward; it keeps the residual
stream after attention, and q and k before q/k norms (`activation_bytes_per_token_layer`).

A vision-language model (issue 61) adds its vision tower: its parameters are the model's (state, grads and
optimizer state as the rest's; no grads or optimizer state when `model.freeze_vision_tower`), and a micro-batch's
image tokens, which sit inside its prompts (data.max_prompt_length counts them: no extra decoder tokens), each bring
merge^2 patches through every vision block. A trained tower keeps each block's activations per patch (counted as a
decoder layer's are, at the tower's width); a frozen one keeps none, only one block's forward at a time. Under
Ulysses (sp > 1) every rank of a group runs the tower on all of the micro-batch's images, not on its piece's.
"""

from __future__ import annotations

import math

from shardrl.config.schema import Config
from shardrl.plan.compiling import compile_choice
from shardrl.plan.layout import DTYPE_BYTES, GIB, Layout, format_count, format_size
from shardrl.models.config import text_config
from shardrl.models.families import (FAMILIES, Family, expert_intermediate_size, gated_mlp, is_moe, moe_layer_count,
                                     num_experts)
from shardrl.plan.step_plan import old_log_probs_from_update

SEQ_BUCKET = 128  # the fast rollout's cache length granularity (FastRollout.seq_bucket)
PREFILL_TOKENS = 16384  # FastRollout.prefill_tokens


def model_numbers(hf_config, trust_remote_code: bool = False, lora=None, freeze_vision_tower: bool = False) -> dict:
    """Parameter counts of the model (built on the meta device): total, largest FSDP unit, largest tensor,
    `trained` (with `lora`, a `model.lora` section of rank > 0: the adapters; else every parameter), `frozen` (the
    vision tower's under `freeze_vision_tower` or LoRA, which adapts the language model only; else 0) and `vision`
    (`vision_numbers`; None for a text model)."""
    import torch
    import transformers

    from shardrl.engine.model import decoder_blocks, untied_head
    from shardrl.models.vision import is_vision_language

    vl = is_vision_language(hf_config)
    auto = transformers.AutoModelForImageTextToText if vl else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config, trust_remote_code=trust_remote_code)
    vision = vision_numbers(model) if vl else None
    trained = None
    if lora is not None and lora.rank > 0:
        from shardrl.engine.lora import LORA_MARK, inject_lora

        inject_lora(model, lora)
        trained = sum(p.numel() for n, p in model.named_parameters() if LORA_MARK in n)
    params = list(model.parameters())
    total = sum(p.numel() for p in params) - (trained or 0)  # the model's own parameters
    head = untied_head(model)
    blocks = [sum(p.numel() for p in b.parameters()) for b in decoder_blocks(model)]
    return dict(total=total, largest_unit=max([*blocks, total - sum(blocks)]), largest_block=max(blocks, default=0),
                root_unit=total - sum(blocks), largest_tensor=max(p.numel() for p in params), trained=trained,
                frozen=vision["params"] if vision and (freeze_vision_tower or trained) else 0, vision=vision,
                untied_head=head.weight.numel() if head is not None else 0)


def critic_numbers(numbers: dict, hf_config) -> dict:
    """`model_numbers` for the critic: no adapters, a value head (hidden -> 1, with bias) more, and its lm_head (the
    value head reads the decoder instead) not trained unless it is the embedding too (`PolicyModel`): no gradients
    or AdamW state for it."""
    frozen = numbers.get("frozen", 0)
    what = ("the vision tower and lm_head" if frozen else "lm_head") if numbers.get("untied_head") else "the vision tower"
    return {**numbers, "trained": None, "total": numbers["total"] + text_config(hf_config).hidden_size + 1,
            "frozen": frozen + numbers.get("untied_head", 0), "frozen_what": what}


def vision_numbers(model) -> dict:
    """A VL model's vision tower: its parameters, blocks (depth), width, heads, MLP width (gated or not) and the
    patches a merged image token stands for (merge^2)."""
    from shardrl.models.vision import vision_family

    import torch.nn as nn

    tower = model.get_submodule(vision_family(model.config).vision_tower)
    block = tower.blocks[0]  # widths read off the block (Qwen2-VL's config says embed_dim and mlp_ratio instead)
    first = next(m for m in block.mlp.modules() if isinstance(m, nn.Linear))
    return dict(params=sum(p.numel() for p in tower.parameters()), depth=len(tower.blocks),
                hidden=first.in_features, inter=first.out_features, gated=hasattr(block.mlp, "gate_proj"),
                patches=tower.spatial_merge_size ** 2)


def vision_activation_bytes_per_patch_block(vision: dict, compute: int) -> tuple[int, str]:
    """Bytes autograd keeps per patch per vision block (as a decoder layer's: two norms, q, k, v, the attention's
    output and the projection's input, the MLP's tensors), and the formula."""
    h, inter, mlp_tensors = vision["hidden"], vision["inter"], 4 if vision["gated"] else 2
    per = 2 * (4 * h + compute * h) + 5 * compute * h + mlp_tensors * compute * inter
    return per, (f"2 norms x (4+{compute}) B x {h} + attention 5 x {compute} B x {h} + MLP {mlp_tensors} x "
                 f"{compute} B x {inter}")


def vision_terms(numbers: dict, image_tokens: int, bound: str, compute: int, train: bool,
                 gradient_checkpointing: bool = False) -> list:
    """The vision tower's terms for a micro-batch holding at most `image_tokens` image tokens (`bound` says why):
    trained, every block's activations of its patches (checkpointed: each block's input and one block's set);
    frozen or forward only, one block's forward at a time."""
    vision = numbers.get("vision")
    if not vision:
        return []
    patches = image_tokens * vision["patches"]
    what = f"{image_tokens} image tokens ({bound}) x {vision['patches']} patches"
    if train and not numbers.get("frozen"):
        per, formula = vision_activation_bytes_per_patch_block(vision, compute)
        depth, h = vision["depth"], vision["hidden"]
        if gradient_checkpointing:
            return [("vision activations", patches * (depth * compute * h + per),
                     f"checkpointing: {what} x ({depth} block inputs x {compute} B x {h} + one block: {formula})")]
        return [("vision activations", patches * depth * per, f"{what} x {depth} blocks x {per} B ({formula})")]
    h, inter = vision["hidden"], vision["inter"]
    return [("vision forward", patches * (4 * h + 2 * inter) * compute,
             f"{what} x one block's (4 x {h} + 2 x {inter}) x {compute} B"
             f"{' (frozen: no activations kept)' if train else ''}")]


def activation_bytes_per_token_layer(hf_config, compute: int, compiled: bool = False) -> tuple[int, str]:
    """Bytes autograd keeps per token per decoder layer (see the module docstring), and the formula. `compiled`: the
    layer runs `torch.compile`d (`engine.compile`), whose partitioner recomputes the cheap elementwise work in the
    backward instead of keeping it: each RMSNorm keeps its fp32 scale (not its fp32 input), the hidden-width tensors
    kept are q/k/v's input, the residual stream after attention and the MLP's input (Gemma's four norms: q/k/v's
    and the MLP's inputs and the inputs of the norms after attention and after the MLP), attention keeps q, k, v, its
    output, its log-sum-exp and the rotary tables (not o_proj's input), q/k norms (Qwen3, Gemma 3, OLMoE) q and k
    before them and their fp32 scales, a dense gated MLP three of its four hidden-width tensors (counted from the
    tensors compiled Qwen2, Llama, Qwen3 and Gemma layers save: tests/test_plan_compiled.py). A compiled MoE's or
    ungated MLP is counted as eager (not measured)."""
    c = text_config(hf_config)
    h = c.hidden_size
    heads = c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    inter = getattr(c, "intermediate_size", None) or 4 * h
    mlp_tensors = 4 if gated_mlp(c) else 2
    if compiled:
        family = FAMILIES.get(getattr(c, "model_type", None), Family())
        n_norms, wide = (4, 4) if family.gemma else (2, 3)
        norms = wide * compute * h + 4 * n_norms
        attn = compute * (2 * heads * d + 2 * kv * d + 2 * d) + 4 * heads  # q, out; k, v; cos, sin; log-sum-exp
        attn_how = (f"compiled: {n_norms} norms x 4 B + {wide} x {compute} B x {h} + attention {compute} B x "
                    f"(2 x {heads * d} + 2 x {kv * d} + 2 x {d}) + 4 B x {heads}")
        if family.qk_norm:  # q and k before their norms, and the norms' scales (per head; OLMoE's: over all heads)
            scales = 2 if family.qk_norm_whole else heads + kv
            attn += compute * (heads + kv) * d + 4 * scales
            attn_how += f" + q/k norms {compute} B x ({heads * d} + {kv * d}) + 4 B x {scales}"
    else:
        norms = 2 * (4 * h + compute * h)
        attn = compute * (3 * heads * d + 2 * kv * d) + compute * heads * d  # q, out, o_proj input; k, v; + spare
        attn_how = f"2 norms x (4+{compute}) B x {h} + attention {compute} B x (4 x {heads * d} + 2 x {kv * d})"
    if is_moe(c):  # each of a token's k experts keeps its hidden units, its copy of the token's input and output
        k, expert, experts = c.num_experts_per_tok, expert_intermediate_size(c), num_experts(c)
        mlp = k * (mlp_tensors * compute * expert + 2 * compute * h) + 4 * experts
        return norms + attn + mlp, (f"{attn_how} + MLP {k} experts x ({mlp_tensors} x {compute} B x {expert} + "
                                    f"2 x {compute} B x {h}) + router 4 B x {experts}")
    if compiled and gated_mlp(c):  # (the activation or the product is recomputed)
        mlp_tensors = 3
    mlp = mlp_tensors * compute * inter
    return norms + attn + mlp, f"{attn_how} + MLP {mlp_tensors} x {compute} B x {inter}"


def _engine_resident(name, numbers, master, shard, offload_params, offload_optimizer, optimizer: bool,
                     compute: int = 2):
    p, lora, frozen = numbers["total"], numbers.get("trained"), numbers.get("frozen", 0)
    out = []
    if lora and optimizer:  # LoRA: the frozen base in param_dtype, the fp32 adapters; only those are optimized
        out.append((f"{name} params", 0 if offload_params else (p * compute + lora * 4) / shard,
                    "on CPU (offload_params: the frozen base and the adapters)" if offload_params else
                    f"({format_count(p)} frozen x {compute} B + {format_count(lora)} adapters x 4 B) / {shard} "
                    "(shard)"))
        out.append((f"{name} optimizer state", 0 if offload_optimizer else 2 * lora * 4 / shard,
                    "on CPU between updates (offload_optimizer)" if offload_optimizer else
                    f"AdamW 2 x {format_count(lora)} adapters x 4 B / {shard}"))
        return out
    out.append((f"{name} params", 0 if offload_params else p * master / shard,
                "on CPU (offload_params)" if offload_params else
                f"{format_count(p)} x {master} B / {shard} (shard)"))
    if optimizer:
        trained = (f"({format_count(p)} - {format_count(frozen)} frozen: "
                   f"{numbers.get('frozen_what', 'the vision tower')})" if frozen else format_count(p))
        out.append((f"{name} optimizer state", 0 if offload_optimizer else 2 * (p - frozen) * master / shard,
                    "on CPU between updates (offload_optimizer)" if offload_optimizer else
                    f"AdamW 2 x {trained} x {master} B / {shard}"))
    return out


def _update_terms(name: str, engine, hf_config, numbers: dict, master: int, shard: int, tokens: int,
                  gradient_checkpointing: bool, images: tuple[int, str] = (0, ""),
                  compiled: bool = False) -> list[tuple[str, float, str]]:
    """An update's own terms: grads, activations of a micro-batch of `tokens` (and of a VL model's vision tower
    over its `images`: (image tokens at most, why)), unsharded units, the logits chunk, and the optimizer state
    brought back from the CPU. `compiled`: the engine compiles its decoder blocks (fewer activations kept)."""
    c = text_config(hf_config)
    p, layers, h, vocab = numbers["total"], c.num_hidden_layers, c.hidden_size, c.vocab_size
    compute = DTYPE_BYTES[engine.param_dtype]
    per_tok, formula = activation_bytes_per_token_layer(hf_config, compute, compiled)
    if gradient_checkpointing:
        act = tokens * (layers * compute * h + per_tok)
        act_how = f"checkpointing: {tokens} tokens x ({layers} layer inputs x {compute} B x {h} + one layer: {formula})"
    else:
        act = tokens * layers * per_tok
        act_how = f"{tokens} tokens x {layers} layers x {per_tok} B ({formula})"
    how_tokens = "max_token_len_per_gpu" if engine.use_dynamic_bsz else "micro_batch_size_per_gpu x sequence"
    unit, unit_how = numbers["largest_unit"], ""
    ep = engine.expert_parallel_size

    if ep > 1 and is_moe(c):  # a rank gathers its E / ep experts of a layer, not all E
        experts = 3 * num_experts(c) * h * expert_intermediate_size(c)
        block = numbers["largest_block"] - (experts - experts // ep)
        if block >= numbers["root_unit"]:  # (else the root's unit, the embeddings and head, stays the largest)
            unit, unit_how = block, f", {format_count(experts // ep)} of them a layer's experts / ep={ep}"
        else:
            unit = numbers["root_unit"]
    kept = engine.accumulates_unsharded(shard)  # params gathered over the micro-batches
    per_unit = engine.reshard_after_forward and not kept
    whole_why = "accumulate_unsharded: gathered over the micro-batches" if kept else "reshard_after_forward=false"
    chunk = engine.logprob_chunk_size
    lora, frozen = numbers.get("trained"), numbers.get("frozen", 0)
    trained, size = (lora, 4) if lora else (p - frozen, master)
    grads = (f"{name} grads", 0 if engine.offload_params else trained * size / shard,
             "on CPU (offload_params)" if engine.offload_params else
             f"{format_count(trained)}{' adapters' if lora else ''}"
             f"{' (' + numbers.get('frozen_what', 'the vision tower') + ' frozen)' if frozen and not lora else ''}"
             f" x {size} B / {shard}")
    if kept and (engine.offload_params or shard > 1):  # (accumulated unsharded on the GPU, reduced once)
        reduce = DTYPE_BYTES[engine.reduce_dtype]
        whole = (f"{format_count(trained)} unsharded x {reduce} B (reduce_dtype), accumulated on the GPU over the "
                 "micro-batches (accumulate_unsharded), then reduced ")
        if engine.offload_params:
            grads = (f"{name} grads", trained * reduce, whole + "to the CPU")
        else:
            grads = (f"{name} grads", trained * reduce + trained * size / shard,
                     whole + f"to shards of {format_count(trained)} x {size} B / {shard}")
    update = [
        grads,
        ("activations", act, f"{act_how}; tokens: {how_tokens}"),
        *vision_terms(numbers, *images, compute, train=True, gradient_checkpointing=gradient_checkpointing),
        ("unsharded params", (2 * unit if per_unit else p) * compute,
         f"2 units of {format_count(unit)} (one prefetched{unit_how}) x {compute} B" if per_unit
         else f"the whole model x {compute} B ({whole_why})"),
        ("logits chunk", chunk * vocab * (compute + 4 + 4),
         f"{chunk} tokens x {vocab} x ({compute} + 4 + 4) B (logits, log-softmax, its grad)"),
    ]
    if engine.offload_optimizer and not engine.offload_params:  # (offloaded params keep their state on the CPU)
        update.append((f"{name} optimizer state", 2 * (lora or p - frozen) * (4 if lora else master) / shard,
                       "back on GPU for the step"))
    return update


def _inference_term(c, tokens: int, compute: int, chunk: int, passes: str) -> tuple[str, float, str]:
    """An inference pass's own memory: one micro-batch's layer and a logits chunk (`c`: the model's text config)."""
    h, vocab = c.hidden_size, c.vocab_size
    inter = (c.num_experts_per_tok * expert_intermediate_size(c) if is_moe(c)
             else getattr(c, "intermediate_size", None) or 4 * h)
    return ("inference micro-batch", tokens * (4 * h + 2 * inter) * compute + chunk * vocab * 4 * 2,
            f"{tokens} tokens x one layer's (4 x {h} + 2 x {inter}) x {compute} B + logits chunk ({passes})")


def _phases(resident: list, own_terms: dict) -> dict:
    phases = {}
    for name, own in own_terms.items():
        items = [{"name": n, "gib": b / GIB, "how": how, "resident": True} for n, b, how in resident]
        items += [{"name": n, "gib": b / GIB, "how": how, "resident": False} for n, b, how in own]
        phases[name] = {"items": items, "total_gib": sum(i["gib"] for i in items)}
    return phases


def offline_ledger(cfg, layout, hf_config) -> dict:
    """`phase_ledger` for `shardrl sft|dpo|rm` (`layout`: `OfflineLayout`): the trained model's resident state
    (and a DPO reference's weights), plus one update phase."""
    numbers = model_numbers(hf_config, cfg.model.trust_remote_code, cfg.model.lora, cfg.model.freeze_vision_tower)
    master, e = DTYPE_BYTES[cfg.model.dtype], cfg.engine
    shard = layout.engine.shard_size
    resident = _engine_resident("model", numbers, master, shard, e.offload_params, e.offload_optimizer, True,
                                DTYPE_BYTES[e.param_dtype])
    if layout.ref and not numbers["trained"]:  # with LoRA the reference is the model with its adapters off
        resident += _engine_resident("ref", numbers, master, shard, e.offload_params, False, False)
    tokens = e.max_token_len_per_gpu if e.use_dynamic_bsz else \
        e.micro_batch_size_per_gpu * layout.group_size * layout.seq_tokens_per_rank
    # an SFT row's images may sit anywhere in it: every token of the micro-batch may be an image token (under
    # Ulysses the micro-batch is sp x a rank's tokens, and every rank of the group runs the tower on all its images)
    sp = e.ulysses_sequence_parallel_size
    update = _update_terms("model", e, hf_config, numbers, master, shard, tokens, cfg.model.gradient_checkpointing,
                           (tokens * sp, "every token of the micro-batch" + (f" ({sp} ranks' pieces)" if sp > 1 else "")
                            + ", at most"))
    phases = _phases(resident, {"update": update})
    return {"num_params": numbers["total"], "phases": phases, "peak_phase": "update",
            "peak_gib": phases["update"]["total_gib"],
            "not_counted": "CUDA context and allocator cache (nvidia-smi shows more); a reward model's head"}


def _teacher_terms(cfg: Config, layout: Layout, master: int) -> tuple[list, tuple | None]:
    """The teachers' resident term and their inference pass's term (none without a teacher): other models, so
    their own sizes, read from their folders' configs. Several teachers (teacher.by_data_source) are all held:
    their weights add up in one `teacher params` term; their passes run one after another, the largest counts."""
    if layout.teacher is None:
        return [], None
    from shardrl.engine.model import load_hf_config

    e = cfg.teacher.engine
    tokens = e.max_token_len_per_gpu if e.use_dynamic_bsz else e.micro_batch_size_per_gpu * layout.seq_tokens_per_rank
    total, terms = 0, []
    for path in cfg.teacher.paths():
        config = load_hf_config(path, None, cfg.model.trust_remote_code, key=cfg.teacher.key(path))
        total += model_numbers(config, cfg.model.trust_remote_code)["total"]
        terms.append(_inference_term(text_config(config), tokens, DTYPE_BYTES[e.param_dtype], e.logprob_chunk_size,
                                     "teacher"))
    resident = _engine_resident("teacher", {"total": total}, master, layout.teacher.shard_size, e.offload_params,
                                False, False)
    if len(terms) > 1:
        name, gib, detail = resident[0]
        resident[0] = (name, gib, f"{len(terms)} teachers: {detail}")
    return resident, max(terms, key=lambda t: t[1])


def _top_k_terms(cfg: Config, layout: Layout) -> list:
    """The teacher's top-k (algorithm.opd.top_k) of every response token of the rank, gathered on the GPU as its
    pass returns (none without)."""
    k = cfg.algorithm.opd.top_k
    if not k:
        return []
    return [("teacher top-k", layout.samples_per_rank * layout.max_new_tokens * k * 8,
             f"{layout.samples_per_rank} samples x {layout.max_new_tokens} response tokens x {k} "
             "(algorithm.opd.top_k) x (4 B id + 4 B log-prob)")]


def fp8_linear_numbers(hf_config, block_size: int | None) -> tuple[int, int]:
    """(weights, scales) of the linear layers an FP8 rollout quantizes (`fp8_linear_shapes`): a weight's elements take
    1 B, its fp32 scales one per output channel (or per `block_size` x `block_size` tile) 4 B."""
    shapes = fp8_linear_shapes(hf_config)
    weights = sum(o * i for o, i in shapes)
    scales = sum(o if not block_size else -(-o // block_size) * -(-i // block_size) for o, i in shapes)
    return weights, scales


def fp8_linear_shapes(hf_config) -> list[tuple[int, int]]:
    """The (out, in) shapes of the linear layers an FP8 rollout quantizes (`FastCausalLM.quantized_linears`: every
    layer's q/k/v/o, a dense layer's gate/up/down)."""
    c = text_config(hf_config)
    h, heads = c.hidden_size, c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    dense = c.num_hidden_layers - moe_layer_count(c)
    inter = getattr(c, "intermediate_size", None) or 4 * h
    shapes = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d)] * c.num_hidden_layers
    return shapes + [(inter, h), (inter, h), (h, inter)] * dense


def _rollout_resident(cfg: Config, hf_config, numbers: dict, shard: int, compute: int, rollout_bytes: int,
                      cuda: bool) -> tuple[list, str, bool]:
    """The rollout's own copy of the weights (the items it keeps all step long), how LoRA's adapters reach it
    (`lora_sync`: unmerged, merged or full) and whether its linear layers are FP8."""
    p, adapters, actor = numbers["total"], numbers["trained"], cfg.actor.engine
    # LoRA's adapter-only sync (a fast rollout on CUDA, rollout.lora_sync unmerged or merged)
    # (null, as `shardrl plan` sees it before a run resolves it by this ledger: counted as unmerged, the least)
    lora_sync = (cfg.rollout.lora_sync or "unmerged") if adapters and cuda and cfg.rollout.backend != "hf" else "full"
    full_copy = ("rollout weights", p * rollout_bytes, f"a full copy: {format_count(p)} x {rollout_bytes} B")
    fp8 = cfg.rollout.quantization == "fp8" and cfg.rollout.backend != "hf"
    if fp8:  # the linear layers' weights in 1 B and their fp32 scales, the rest in the rollout's dtype
        linear, scales = fp8_linear_numbers(hf_config, cfg.rollout.fp8.block_size)
        full_copy = ("rollout weights", (p - linear) * rollout_bytes + linear + scales * 4,
                     f"FP8: {format_count(linear)} x 1 B + {format_count(scales)} scales x 4 B, the other "
                     f"{format_count(p - linear)} x {rollout_bytes} B")
    items = []
    if lora_sync == "unmerged":
        items.append(("rollout adapters", adapters * 4, f"{format_count(adapters)} x fp32, added at run time"))
        # no rank holds the base whole, or not in the rollout's dtype, or not on the GPU (offload_params):
        if shard > 1 or compute != rollout_bytes or actor.offload_params:
            items.append(full_copy)  # the rollout keeps a copy, sent once
        # else the rollout reads the actor's own base tensors: no copy
    else:
        items.append(full_copy)
        if lora_sync == "merged" and (shard > 1 or actor.offload_params):
            items.append(("rollout's unmerged base", p * rollout_bytes, "the adapted layers' base (at most a "
                          "full copy), what each sync merges into"))
    return items, lora_sync, fp8


def _gen_terms(cfg: Config, layout: Layout, c, numbers: dict, master: int, rollout_bytes: int, lora_sync: str,
               fp8: bool) -> list:
    """Generation's own terms: the weight export's transient, the KV cache, the sampler's logits, one prefill chunk."""
    layers, h, vocab = c.num_hidden_layers, c.hidden_size, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    fast = cfg.rollout.fast
    slots = layout.samples_per_rank if fast.max_batch is None else min(fast.max_batch, layout.samples_per_rank)
    max_seq = math.ceil(layout.max_seq_len / SEQ_BUCKET) * SEQ_BUCKET
    per_position = layers * 2 * kv_heads * d * rollout_bytes

    # a token's MLP width: its k experts' (each computed on the token's own copy) in a mixture of experts
    inter = (c.num_experts_per_tok * expert_intermediate_size(c) if is_moe(c)
             else getattr(c, "intermediate_size", None) or 4 * h)
    prefill = min(PREFILL_TOKENS, slots * layout.max_prompt_length)
    positions, what = slots * max_seq, f"{slots} slots x {max_seq} positions"
    if fast.kv_cache_tokens is not None and fast.kv_cache_tokens < positions:
        positions = fast.kv_cache_tokens
        what = f"rollout.fast.kv_cache_tokens={positions} positions (of {what})"
    adapters = numbers["trained"]
    return [
        ("KV cache", positions * per_position,
         f"{what} x {layers} layers x 2 x {kv_heads} x {d} x {rollout_bytes} B"),
        ("sampler logits", slots * vocab * 4 * 2, f"{slots} x {vocab} vocab x fp32 x 2 (logits, noise)"),
        ("prefill chunk", prefill * (4 * h + 2 * inter) * rollout_bytes,
         f"{prefill} tokens x (4 x {h} + 2 x {inter}) x {rollout_bytes} B"),
        ("weight export", numbers["largest_tensor"] * (master + rollout_bytes + (8 if fp8 else 0)),
         f"largest tensor {format_count(numbers['largest_tensor'])} gathered x ({master} + {rollout_bytes}"
         f"{' + 8 (fp32 copy and quotient, FP8)' if fp8 else ''}) B")
        if lora_sync == "full" else ("adapter sync", adapters * 4,
                                     f"the {format_count(adapters)} adapters gathered, fp32"),
    ]


def _micro_batch_tokens_and_images(cfg: Config, layout: Layout) -> tuple[int, tuple]:
    """A micro-batch's tokens on a rank, and the image tokens it can hold with what bounds them: a VL prompt's image
    tokens are inside data.max_prompt_length, so a micro-batch's rows' prompts bound them; under Ulysses every rank
    of the group runs the tower on all the micro-batch's images (sp x a rank's tokens)."""
    actor, sp = cfg.actor.engine, layout.sp
    tokens = actor.max_token_len_per_gpu if actor.use_dynamic_bsz else actor.micro_batch_size_per_gpu * \
        layout.seq_tokens_per_rank
    if actor.use_dynamic_bsz:
        return tokens, (tokens * sp, "max_token_len_per_gpu" + (f" x {sp} (sp)" if sp > 1 else "") + ", at most")
    rows = (f"{actor.micro_batch_size_per_gpu} (micro_batch_size_per_gpu) x {layout.max_prompt_length} "
            "(max_prompt_length)")
    return tokens, (min(tokens * sp, actor.micro_batch_size_per_gpu * layout.max_prompt_length), rows)


def phase_ledger(cfg: Config, layout: Layout, hf_config, cuda: bool = True) -> dict:
    """{"phases": {phase: {"items": [(name, GiB, how)], "total_gib"}}, "peak_phase", "peak_gib"} for one GPU of
    the run `cfg` laid out as `layout` (the busiest rank's share). `cuda`: the rollout keeps a bf16 copy of
    the weights (on CPU the HF rollout's fp32 one)."""
    c = text_config(hf_config)
    numbers = model_numbers(hf_config, cfg.model.trust_remote_code, cfg.model.lora, cfg.model.freeze_vision_tower)
    master = DTYPE_BYTES[cfg.model.dtype]
    actor = cfg.actor.engine
    compute = DTYPE_BYTES[actor.param_dtype]
    shard = layout.actor.shard_size
    rollout_bytes = 2 if cuda else 4
    resident = _engine_resident("actor", numbers, master, shard, actor.offload_params, actor.offload_optimizer, True,
                                compute)
    rollout, lora_sync, fp8 = _rollout_resident(cfg, hf_config, numbers, shard, compute, rollout_bytes, cuda)
    resident += rollout
    plain = {**numbers, "trained": None}  # a separate reference runs without the adapters
    if layout.ref is not None and not numbers["trained"]:  # with LoRA the reference is the actor, adapters off
        e = cfg.ref.engine
        resident += _engine_resident("ref", plain, master, layout.ref.shard_size, e.offload_params, False, False)
    teacher_resident, teacher_prep = _teacher_terms(cfg, layout, master)
    resident += teacher_resident
    if layout.critic is not None:
        e = cfg.critic.engine
        resident += _engine_resident("critic", critic_numbers(numbers, hf_config), master, layout.critic.shard_size,
                                     e.offload_params, e.offload_optimizer, True)
    gen = _gen_terms(cfg, layout, c, numbers, master, rollout_bytes, lora_sync, fp8)

    # prep: an inference pass (old log-probs, reference, values) holds one micro-batch's layer and logits chunk
    tokens, images = _micro_batch_tokens_and_images(cfg, layout)
    passes = [name for name, runs in (("old log-probs", not old_log_probs_from_update(cfg)[0]),
                                      ("reference", layout.ref is not None), ("values", layout.critic is not None))
              if runs]
    prep = [_inference_term(c, tokens, compute, actor.logprob_chunk_size, ", ".join(passes))] if passes else []
    if passes:
        prep += vision_terms(numbers, *images, compute, train=False)
    if teacher_prep is not None:  # the passes run one after another: the larger model's counts
        prep = [max([*prep, teacher_prep], key=lambda t: t[1]), *_top_k_terms(cfg, layout)]

    compiled, why = (actor.compile, "actor.engine.compile") if actor.compile is not None else \
        compile_choice(actor, hf_config, cuda)  # null: as the run on this device would choose (CPU: eager)
    update = _update_terms("actor", actor, hf_config, numbers, master, shard, tokens, cfg.model.gradient_checkpointing,
                           images, compiled)
    if compiled and actor.compile is None:  # say why a config that names no compile is counted compiled
        update = [(name, size, f"{how}; counted compiled: actor.engine.compile=null compiles on a GPU ({why})")
                  if name == "activations" else (name, size, how) for name, size, how in update]
    if cfg.actor.router_replay.mode == "R2" and is_moe(hf_config):  # the routing recorded, then replayed
        routed = tokens * moe_layer_count(hf_config) * c.num_experts_per_tok
        prep.append(("recorded routing", routed * (8 + 2), f"{tokens} tokens x {moe_layer_count(hf_config)} MoE "
                     f"layers x top-{c.num_experts_per_tok} x (8 B as recorded + 2 B stacked as int16)"))
        update.append(("replayed routing", routed * 2, f"{tokens} tokens x {moe_layer_count(hf_config)} MoE layers x "
                       f"top-{c.num_experts_per_tok} x 2 B (int16)"))
    if cuda and cfg.rollout.free_cache_engine is False:  # the rollout keeps its cache through prep and the update
        kept = [(f"{name} (kept)", size, f"{how}; rollout.free_cache_engine=false") for name, size, how in gen
                if name in KEPT_CACHE]
        prep, update = prep + kept, update + kept

    phases = _phases(resident, {"gen": gen, "prep": prep, "update": update})
    peak = max(phases, key=lambda k: phases[k]["total_gib"])
    return {"num_params": numbers["total"], "phases": phases, "peak_phase": peak,
            "peak_gib": phases[peak]["total_gib"],
            "not_counted": "CUDA context and allocator cache (nvidia-smi shows more), a reward model, CUDA graphs"}


KEPT_CACHE = ("KV cache", "sampler logits")
"""What a rollout that keeps its cache (`rollout.free_cache_engine=false`) holds through prep and the update."""


def update_and_cache_gib(ledger: dict) -> float:
    """A `phase_ledger`'s update GiB plus the rollout's KV cache and sampler logits: what the GPU holds when the
    rollout keeps its cache through the update (`rollout.free_cache_engine`; a ledger made with it false
    counts them already)."""
    update = ledger["phases"]["update"]
    if any(i["name"].endswith("(kept)") for i in update["items"]):
        return update["total_gib"]
    cache = sum(i["gib"] for i in ledger["phases"]["gen"]["items"] if i["name"] in KEPT_CACHE)
    return update["total_gib"] + cache


ADVICE = {
    "KV cache": "fewer decode slots (rollout.fast.max_batch), a cache budget (rollout.fast.kv_cache_tokens) or a "
                "shorter data.max_prompt_length / rollout.max_new_tokens",
    "prefill chunk": "fewer decode slots (rollout.fast.max_batch) or a shorter data.max_prompt_length (a prefill "
                     "takes at most the slots' prompts)",
    "activations": "model.gradient_checkpointing=true, or a smaller {engine}.max_token_len_per_gpu "
                   "(micro_batch_size_per_gpu without dynamic batching)",
    "inference micro-batch": "a smaller {engine}.max_token_len_per_gpu (micro_batch_size_per_gpu without dynamic "
                             "batching)",
    "unsharded params": "{engine}.accumulate_unsharded=false and {engine}.reshard_after_forward=true (the model "
                        "gathered a unit at a time, not whole over the micro-batches)",
    "actor optimizer state": "actor.engine.offload_optimizer=true, or more GPUs to shard it over",
    "actor params": "actor.engine.offload_params=true, or more GPUs to shard over",
    "actor grads": "actor.engine.offload_params=true (grads follow the params), or more GPUs",
    "rollout weights": "a smaller model: every GPU holds the rollout's full copy",
    "sampler logits": "fewer decode slots (rollout.fast.max_batch)",
    "KV cache (kept)": "rollout.free_cache_engine=true (the cache freed for the update), or fewer decode slots "
                       "(rollout.fast.max_batch)",
    "sampler logits (kept)": "rollout.free_cache_engine=true (the cache freed for the update)",
    "logits chunk": "a smaller {engine}.logprob_chunk_size",
    # the offline trainers' (`offline_ledger`)
    "model optimizer state": "engine.offload_optimizer=true, or more GPUs to shard it over",
    "model params": "engine.offload_params=true, or more GPUs to shard over",
    "model grads": "engine.offload_params=true (grads follow the params), or more GPUs",
    "ref params": "engine.offload_params=true, or more GPUs to shard over",
    "teacher params": "teacher.engine.offload_params=true, or more GPUs to shard over",
}
"""What shrinks each term of the ledger; a term held all step (resident) is in every phase, so a phase whose largest
term is resident is also told what shrinks its own largest (`fit_advice`)."""


def largest_term(phase: dict) -> dict:
    return max(phase["items"], key=lambda i: i["gib"])




def fit_advice(ledger: dict, gpu_mem_gib: float, engine: str = "actor.engine") -> list[str]:
    """Lines saying, for each phase over `gpu_mem_gib`, by how much and what to change; [] when all fit. Where the
    largest term is held all step, the line also names the phase's own largest term and what shrinks it: what
    changes that phase alone."""
    def advice(term: dict) -> str:
        said = ADVICE.get(term["name"], "see the terms above")
        return said.format(engine=engine)

    lines = []
    for name, phase in ledger["phases"].items():
        if phase["total_gib"] <= gpu_mem_gib:
            continue
        top = largest_term(phase)
        line = (f"{name} needs {format_size(phase['total_gib'])} > {gpu_mem_gib:g} GiB; the largest term is "
                f"{top['name']} ({format_size(top['gib'])}{', held all step' if top['resident'] else ''}): "
                f"{advice(top)}")
        own = [i for i in phase["items"] if not i["resident"] and i["name"] in ADVICE]  # (what can be changed)
        if top["resident"] and own:
            mine = max(own, key=lambda i: i["gib"])
            line += f"; this phase's own largest is {mine['name']} ({format_size(mine['gib'])}): {advice(mine)}"
        lines.append(line)
    return lines


def format_phase_ledger(ledger: dict) -> str:
    lines = [f"peak GPU memory per phase (one GPU; {format_count(ledger['num_params'])} params):"]
    first = next(iter(ledger["phases"]))  # the resident terms are listed under the first phase only
    width = max(len(i["name"]) for ph in ledger["phases"].values() for i in ph["items"])
    for name, phase in ledger["phases"].items():
        top = largest_term(phase)
        lines.append(f"  {name}: {format_size(phase['total_gib'], 2)} (largest: {top['name']})")
        for i in phase["items"]:
            if i["resident"] and name != first:
                continue
            tag = "resident " if i["resident"] else ""
            lines.append(f"    {tag + i['name']:<{width + 9}} {format_size(i['gib'], 3):>12}  # {i['how']}")
        if name != first:
            lines.append(f"    {'(+ the resident terms above)':<{width + 9}}")
    lines.append(f"  peak: {ledger['peak_phase']} {format_size(ledger['peak_gib'], 2)}; not counted: "
                 f"{ledger['not_counted']}")
    return "\n".join(lines)
