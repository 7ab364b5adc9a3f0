"""The `shardrl` command: `plan` (a config's per-rank layout and memory, before any GPU is touched),
`doctor` (what this machine can run), `train` and `plot`.

    shardrl plan run.yaml rollout.n=8 --nnodes 2 --nproc-per-node 8
    shardrl doctor
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shutil
import sys
from importlib import metadata

from shardrl import __version__
from shardrl.config.registry import TRAINERS
from shardrl.launch.overrides import EXAMPLES

TRAIN_EPILOG = ("With no arguments, `shardrl train` runs the built-in demo: GRPO teaches a tiny model single-digit "
                "addition on the CPU. Overrides alone (`shardrl train trainer.total_steps=50`) change the demo, unless "
                "one names a model or data (model.path, model.tiny, data.train_files, ...): then the run starts from "
                "the plain defaults. `shardrl config` lists every key.")


def _gib(text: str) -> float:
    """An argparse type: a GPU's memory in GiB, a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB > 0, got {text}")
    return value


SERVE_DEFAULT_MAX_TOKENS = 2048
"""`shardrl serve`'s max_tokens for a request that gives none: a prompt of as many tokens and this reply fit a stream
slot's positions (`serving.batcher.STREAM_SEQ`, 4096), so such requests keep every slot (vLLM's default, what is left
of the context, would hold a 32k model's streams to an eighth of their slots)."""


def _count(text: str) -> int:
    """An argparse type: a whole number >= 1 (0 is not "unset": it is refused)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help="an optional YAML config file, then dotted key=value overrides")
    p.add_argument("--nnodes", type=_count, default=None, help="nodes (default: trainer.nnodes)")
    p.add_argument("--nproc-per-node", type=_count, default=None,
                   help="processes per node (default: trainer.nproc_per_node)")


def _add_verl_args(p: argparse.ArgumentParser, command: str = "python3 -m verl.trainer.main_ppo") -> None:
    p.add_argument("--verl", action="store_true",
                   help=f"the arguments are verl's key=value lines ({command} ...), "
                        "translated to shardrl's keys, which are printed")
    p.add_argument("--config-path", default=None, help="with --verl: verl's Hydra config folder")
    p.add_argument("--config-name", default=None, help="with --verl: the YAML in it (verl's --config-name)")


def _split_config_args(args: argparse.Namespace) -> None:
    """Sets `args.config` (the first positional when it is not key=value) and `args.overrides`."""
    rest = list(args.args)
    args.config = rest.pop(0) if rest and "=" not in rest[0] else None
    args.overrides = rest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardrl", description="RL post-training for LLMs on FSDP2")
    parser.add_argument("--version", action="version", version=f"shardrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the per-rank batch layout and memory ledger of a config")
    _add_config_args(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan.add_argument("--gpu-mem-gib", type=_gib, default=None, metavar="GIB",
                      help="say whether each phase's predicted peak fits a GPU of this size, and what to change "
                           "when one does not (exit status 1)")
    plan.add_argument("--trainer", choices=tuple(TRAINERS), default="train",
                      help="the command the config is for (default: train, the RL trainer)")

    sub.add_parser("doctor", help="report what this machine can run")

    train = sub.add_parser("train", help=TRAINERS["train"].help, epilog=TRAIN_EPILOG)
    _add_config_args(train)
    for p in (plan, train):
        _add_verl_args(p)
        p.add_argument("--example", choices=EXAMPLES, default=None,
                       help="a built-in example's settings first (key=value overrides still win): demo (what "
                            "`shardrl train` alone runs) or reasoning_gym (GRPO on reasoning-gym's leg_counting)")

    for name, trainer in TRAINERS.items():
        if trainer.offline:
            offline = sub.add_parser(name, help=trainer.help)
            _add_config_args(offline)
            if name == "sft":
                _add_verl_args(offline, "torchrun -m verl.trainer.fsdp_sft_trainer")

    serve = sub.add_parser("serve", help="serve a config's model on an OpenAI-compatible HTTP endpoint")
    _add_config_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=_port, default=8000, help="the TCP port (default: %(default)s; 0: any free one)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in requests (default: the model folder's name)")
    serve.add_argument("--max-batch", type=_count, default=None, metavar="N",
                       help="requests generated together at most (default: rollout.fast.max_batch)")
    serve.add_argument("--front-end", choices=["process", "thread"], default="process",
                       help="where HTTP is served: a process of its own (default; the generation never waits for it "
                            "on the interpreter lock), or a thread of the engine's")
    serve.add_argument("--front-ends", type=int, default=1, metavar="N",
                       help="front-end processes sharing the port (default 1; each parses and tokenizes requests on a "
                            "core of its own, about 1,000 requests/s apiece)")
    serve.add_argument("--stream-interval", type=_count, default=1, metavar="N",
                       help="a streamed reply's tokens go out once at least N have come since its last chunk (default "
                            "1: at every host sync of the engine, 16 tokens; larger: fewer, longer chunks, less work "
                            "for the front end), as vLLM's --stream-interval")
    serve.add_argument("--default-max-tokens", type=_count, default=SERVE_DEFAULT_MAX_TOKENS, metavar="N",
                       help="what a request without max_tokens (max_completion_tokens, max_output_tokens) may "
                            "sample, at most what is left of the context (default: %(default)s; agent frameworks "
                            "mostly send none). A training config's rollout.max_new_tokens is not read here")
    serve.add_argument("--max-body-mb", type=_count, default=8, metavar="MIB",
                       help="a request body larger than this many MiB is refused with a 413 (default: %(default)s)")
    serve.add_argument("--max-prompts", type=_count, default=1024, metavar="N",
                       help="a /v1/completions request of more prompts (or prompts times n) is refused with a 400 "
                            "(default: %(default)s)")
    serve.add_argument("--max-messages", type=_count, default=4096, metavar="N",
                       help="a chat request of more messages is refused with a 400 (default: %(default)s)")
    serve.add_argument("--logprobs-mode", choices=["processed_logprobs", "raw_logprobs"],
                       default="processed_logprobs",
                       help="the replies' log-probs: the sampled distribution's, log softmax(logits / temperature) "
                            "before top-k/top-p (default; what shardrl's trainer recomputes), or the model's own, "
                            "log softmax(logits) (vLLM's default)")
    serve.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "mistral"], default="auto",
                       help="how a chat reply's tool calls are read into tool_calls when a request gives tools "
                            "(vLLM's names): hermes (Hermes, Qwen2.5, Qwen3: <tool_call>), llama3_json (Llama 3.x), "
                            "mistral ([TOOL_CALLS]); auto (default): told from the chat template, else hermes")
    serve.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                       help="PEFT LoRA adapter folders served over the model, each under its NAME (a request's "
                            "`model`; the model's own name serves the base), as vLLM's: NAME=PATH or JSON "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}', several or the flag "
                            "repeated; give config overrides before it")

    _add_config_parser(sub)

    plot = sub.add_parser("plot", help="plot the metrics of a run folder, or overlay every run of a folder of runs")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, or a folder of them (outputs/EXPERIMENT, "
                                                         "outputs): its runs overlaid, a legend entry each")
    plot.add_argument("--out", metavar="PNG", default=None, help="image path (default: inside RUN_DIR)")
    return parser


def _plan_config(args: argparse.Namespace, trainer):
    """The config the command would run, as `plan_main` reads it (an offline trainer's, a verl command line's, or
    train's with its example or the demo's settings)."""
    from shardrl.config.schema import load_config
    from shardrl.launch.overrides import resolve_overrides, verl_overrides

    if trainer.offline:
        overrides = list(args.overrides)
        if args.verl and args.trainer == "sft":  # a verl SFT command line, as `shardrl sft --verl` runs it
            overrides = verl_overrides(args.config, overrides, args.config_path, args.config_name, trainer="sft")
        elif args.verl:
            raise ValueError(f"--verl translates verl's PPO (--trainer train) and SFT (--trainer sft) command lines, "
                             f"not --trainer {args.trainer}")
        return load_config(args.config, overrides, cls=trainer.config)
    if args.verl:  # a verl command line, as `shardrl train --verl` runs it
        return load_config(None, verl_overrides(args.config, list(args.overrides), args.config_path, args.config_name))
    # the config train would run (the demo's, without a config or a model: its assets are made by its first run)
    return load_config(args.config, resolve_overrides(args.config, list(args.overrides), make_demo_assets=False,
                                                      example=args.example))


def _plan_ledger(cfg, layout, trainer, hub_error: str | None) -> tuple[dict | None, str | None, object]:
    """(ledger, why it was skipped, the model's config) for `plan_main`: no ledger where the model's config cannot be
    read (the layout stands on its own); a bad key or heads that do not divide are errors, as training makes them."""
    from shardrl.config.schema import ConfigError
    from shardrl.engine.model import check_tiny_shape, load_hf_config
    from shardrl.models.config import text_config
    from shardrl.plan.layout import check_model_heads
    from shardrl.plan.memory import offline_ledger, phase_ledger

    offline = trainer.offline
    try:
        hf_config = load_hf_config(cfg.model.path, cfg.model.tiny, cfg.model.trust_remote_code,
                                   task="seq_cls" if trainer.head == "score" else "causal_lm", new_head_ok=True,
                                   override=cfg.model.override_config)
    except ConfigError:  # a bad key, as training would refuse it
        raise
    except ValueError as e:  # no usable model config: the layout still stands on its own
        skipped = hub_error or str(e)
        from shardrl.launch.overrides import example_settings

        for name in EXAMPLES:
            assets, _ = example_settings(name, make_assets=False)
            made_by_first_run = cfg.model.path == str((assets / "model").resolve()) and not os.path.isdir(cfg.model.path)
            if not offline and made_by_first_run:
                skipped = ("the built-in demo's model is made by its first run (shardrl train)" if name == "demo" else
                           f"the {name} example's model is made by its first run (shardrl train --example {name})")
        return None, skipped, None
    check_model_heads(layout, hf_config, "engine" if offline else "actor.engine")  # heads vs sp, as training
    if cfg.model.tiny:
        check_tiny_shape(text_config(hf_config), "head_dim" in cfg.model.tiny)
    try:
        return (offline_ledger(cfg, layout, hf_config) if offline else phase_ledger(cfg, layout, hf_config)), None, \
            hf_config
    except (ValueError, AttributeError) as e:  # a config without the usual decoder names
        return None, str(e), hf_config


def plan_main(args: argparse.Namespace) -> int:
    from shardrl.plan.defaults import free_cache_choice, lora_sync_choice
    from shardrl.plan.layout import format_layout, format_offline_layout, format_size
    from shardrl.plan.memory import fit_advice, format_phase_ledger, phase_ledger, update_and_cache_gib
    from shardrl.plan.offload import plan_host_adam
    from shardrl.plan.plan import Plan

    trainer = TRAINERS[args.trainer]
    offline = trainer.offline
    cfg = _plan_config(args, trainer)
    for line in cfg.ignored_settings():  # (as the run would warn)
        print(f"warning: {line}", file=sys.stderr)
    nnodes = args.nnodes if args.nnodes is not None else cfg.trainer.nnodes
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.trainer.nproc_per_node
    hub_error = _plan_hub_path(cfg)
    plan = Plan.for_offline(cfg, args.trainer, nnodes, nproc) if offline else Plan.for_rl(cfg, nnodes, nproc)
    layout = plan.layout
    ledger, skipped, hf_config = _plan_ledger(cfg, layout, trainer, hub_error)
    lora_choice = None  # rollout.lora_sync left null with LoRA on a GPU of --gpu-mem-gib: as the run settles it
    if ledger and args.gpu_mem_gib and not offline and cfg.model.lora.rank > 0 and cfg.rollout.lora_sync is None:
        import torch

        cfg = copy.deepcopy(cfg)
        cfg.rollout.lora_sync, why_sync = lora_sync_choice(cfg, layout, hf_config, torch.device("cuda"),
                                                           gpu_gib=args.gpu_mem_gib)
        lora_choice = f"rollout.lora_sync={cfg.rollout.lora_sync} (null: {why_sync})"
        ledger = phase_ledger(cfg, layout, hf_config)
    advice = fit_advice(ledger, args.gpu_mem_gib, "engine" if offline else "actor.engine") \
        if ledger and args.gpu_mem_gib else []
    keep_cache = None  # rollout.free_cache_engine left null on a GPU of --gpu-mem-gib: kept through the update?
    if ledger and args.gpu_mem_gib and not offline and cfg.rollout.free_cache_engine is None:
        free, why = free_cache_choice((update_and_cache_gib(ledger), args.gpu_mem_gib), cuda=True)
        keep_cache = not free
        if keep_cache:  # the phases as the run will hold them: the cache kept through prep and the update
            kept = copy.deepcopy(cfg)
            kept.rollout.free_cache_engine = False
            ledger = phase_ledger(kept, layout, hf_config)
    # offloaded parameters: their AdamW step runs on the host's CPU (sized where the ledger is)
    host_adam = plan_host_adam(cfg, layout, hf_config, nproc, offline) if ledger else None
    if args.json:
        print(json.dumps({**layout.to_dict(), "memory": ledger, "memory_skipped": skipped, "host_adam": host_adam,
                          "fits": None if args.gpu_mem_gib is None or ledger is None else not advice,
                          "advice": advice, "rollout_keeps_cache": keep_cache,
                          "rollout_lora_sync": cfg.rollout.lora_sync if lora_choice else None}))
    else:
        print(format_offline_layout(layout) if offline else format_layout(layout))
        print()
        print(format_phase_ledger(ledger) if ledger else f"memory ledger: skipped ({skipped})")
        if ledger and args.gpu_mem_gib:
            print(f"\ndoes not fit {args.gpu_mem_gib:g} GiB:\n  " + "\n  ".join(advice) if advice
                  else f"\nfits {args.gpu_mem_gib:g} GiB (peak {ledger['peak_phase']} "
                       f"{format_size(ledger['peak_gib'])})")
        if host_adam:
            print(host_adam["line"])
        if lora_choice:
            print(lora_choice)
        if keep_cache is not None:
            print(f"rollout.free_cache_engine={str(not keep_cache).lower()} (null: {why})")
    if args.gpu_mem_gib and not ledger:  # a verdict was asked for and none can be given
        print(f"error: no verdict on --gpu-mem-gib {args.gpu_mem_gib:g}: the memory ledger needs the model's config "
              f"({skipped})", file=sys.stderr)
        return 2
    return 1 if advice else 0


def _version(dist_name: str) -> str:
    try:
        return f"ok ({metadata.version(dist_name)})"
    except metadata.PackageNotFoundError:
        return "missing"


def doctor_lines() -> list[tuple[str, str]]:
    lines = [("python", f"ok ({platform.python_version()}, {sys.executable})")]
    try:
        import torch
    except ImportError:
        return lines + [("torch", "missing")]
    import torch.distributed as dist

    lines.append(("torch", f"ok ({torch.__version__}, CUDA build {torch.version.cuda or 'none'})"))
    cuda = torch.cuda.is_available()
    if cuda:
        devices = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        names = ", ".join(f"{d.name} {d.total_memory / 1024**3:.0f} GiB" for d in devices)
        lines.append(("cuda", f"ok ({len(devices)} device(s): {names})"))
    else:
        why = "no CUDA device visible" if torch.version.cuda else "this torch is a CPU-only build"
        lines.append(("cuda", f"not usable here: {why}"))
    if not dist.is_available():
        lines += [("nccl", "missing (torch.distributed not built)"), ("gloo", "missing (torch.distributed not built)")]
    else:
        if not dist.is_nccl_available():
            lines.append(("nccl", "missing"))
        else:
            lines.append(("nccl", "ok" if cuda else "not usable here: built in, but no CUDA device"))
        lines.append(("gloo", "ok" if dist.is_gloo_available() else "missing"))
    lines.append(("transformers", _version("transformers")))
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        lines.append(("fsdp2", "ok (fully_shard; gloo on CPU, NCCL on GPU)"))
    except ImportError as e:
        lines.append(("fsdp2", f"missing ({e})"))
    lines.append(("fsdp1", "ok" if cuda else "not usable here: FSDP1 needs CUDA"))
    for name in ("pyarrow", "safetensors"):
        lines.append((name, _version(name)))
    free = shutil.disk_usage(os.getcwd()).free / 1024**3
    lines.append(("disk", f"ok ({free:.1f} GiB free in {os.getcwd()})"))
    return lines


def doctor_verdict(status: dict[str, str], num_gpus: int) -> str:
    """One line saying what a machine can run, from `doctor_lines`' statuses and its visible CUDA devices."""
    ok = {name for name, text in status.items() if text.startswith("ok")}
    if "torch" not in ok:
        return "nothing runs here yet: install torch (pip install -e . installs it with shardrl)"
    if "transformers" not in ok:
        return "nothing runs here yet: install transformers (pip install -e . installs it with shardrl)"
    if num_gpus == 0:
        if "gloo" not in ok:
            return ("CPU only, one process: the demo and single-process runs work here; several processes need gloo, "
                    "GPU runs need CUDA")
        return ("CPU only: the demo, the tests and gloo runs (several processes, --nproc-per-node N) work here; GPU "
                "runs need CUDA")
    fsdp = " and ".join(name.upper() for name in ("fsdp2", "fsdp1") if name in ok) or "no FSDP"
    gpus = f"{num_gpus} GPU{'s' if num_gpus > 1 else ''}"
    if "nccl" not in ok:
        return (f"{gpus} but no NCCL: one-GPU runs ({fsdp}) and CPU runs work here; several GPUs need a torch built "
                "with NCCL")
    return (f"{gpus}: GPU runs with {fsdp} over NCCL, up to --nproc-per-node {num_gpus} a node, work here, as do "
            "the demo, the tests and gloo runs")


def doctor_main(args: argparse.Namespace) -> int:
    lines = doctor_lines()
    width = max(len(name) for name, _ in lines)
    for name, status in lines:
        print(f"{name:<{width}}  {status}")
    status = dict(lines)
    num_gpus = 0
    if status.get("cuda", "").startswith("ok"):
        import torch

        num_gpus = torch.cuda.device_count()
    print(f"\n{doctor_verdict(status, num_gpus)}")
    return 0


def train_main(args: argparse.Namespace) -> int:
    """`shardrl train|sft|dpo|rm`: the trainer of the command's registry row (`shardrl.launch`)."""
    from shardrl.launch.command import launch_main

    return launch_main(args.command, args) or 0


def _serve_hub_paths(cfg) -> str | None:
    """The config's hub ids resolved to local folders; the model's name in requests when model.path was one (its id,
    not the snapshot folder's hash)."""
    from shardrl.config.hub import resolve_hub_paths

    given = cfg.model.path
    resolve_hub_paths(cfg)
    return given if cfg.model.path != given else None


def _plan_hub_path(cfg) -> str | None:
    """model.path as a hub id: its config.json (all the plan reads) from the hub's cache or downloaded; why it cannot
    be had, else None (the plan goes on without the memory ledger, as for a folder that is not there)."""
    from shardrl.config.hub import resolve_hub_paths

    try:
        resolve_hub_paths(cfg, files="config", keys=("model.path",))
    except ValueError as e:
        return str(e)
    return None


def serve_main(args: argparse.Namespace) -> int:
    import signal
    import sys

    from shardrl.config.schema import load_config
    from shardrl.rollout.serving.frontend import listening_sockets
    from shardrl.rollout.serving.server import uvicorn_server
    from shardrl.rollout.serving.command import ServeOptions, ServerProcess, build_app, build_engine

    if args.front_ends < 1:
        raise SystemExit(f"shardrl serve: --front-ends {args.front_ends}: serve with at least one front-end process")
    if args.front_end == "thread" and args.front_ends != 1:
        raise SystemExit("shardrl serve: --front-ends needs --front-end process (a thread front end is one)")
    try:  # (the port checked before the model loads, which can take minutes)
        listening_sockets(args.host, args.port, 1)[0].close()
    except RuntimeError as e:
        print(f"shardrl serve: {e}", file=sys.stderr)
        return 1
    options = ServeOptions(max_body_bytes=args.max_body_mb * 2**20, logprobs_mode=args.logprobs_mode,
                           max_prompts=args.max_prompts, max_messages=args.max_messages,
                           tool_call_parser=args.tool_call_parser)
    from shardrl.rollout.lora_adapters import parse_lora_modules

    try:
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        print(f"shardrl serve: {e}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    hub_id = _serve_hub_paths(cfg)
    engine = build_engine(cfg, args.served_model_name or hub_id, args.max_batch, lora_modules=lora_modules,
                          stream_interval=args.stream_interval, default_max_tokens=args.default_max_tokens)
    if args.front_end == "thread":
        import uvicorn

        print(f"serving {engine[1]!r} at http://{args.host}:{args.port}/v1 (front end: a thread of this process)",
              flush=True)
        app = build_app(*engine, options=options)
        server = uvicorn_server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
        try:
            server.run()
        except KeyboardInterrupt:  # (uvicorn raises Ctrl-C again after its graceful stop)
            pass
        return 0 if server.started else 3  # (3: its app did not start, as uvicorn.run says)
    try:
        server = ServerProcess(*engine, host=args.host, port=args.port, log_level="info", front_ends=args.front_ends,
                               options=options)
    except RuntimeError as e:  # (a port taken, a front end that did not start: said in one line)
        print(f"shardrl serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (while it started: it stopped what it had started)
        return 0
    pids = ", ".join(map(str, server.pids))
    print(f"serving {engine[1]!r} at {server.url} (front end{'s' if len(server.pids) > 1 else ''}: process "
          f"{pids})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (the front ends stop with this process, not after it)
    try:
        server.wait()
        ended = server.exit_codes()  # (before stop ends the others)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
    print(f"shardrl serve: a front-end process ended on its own ({ended}): the server stopped", file=sys.stderr)
    return 1


def _add_config_parser(sub) -> None:
    config = sub.add_parser("config", help="list every config key with its default and docstring",
                            description="Every key of a command's config, `key = default`, its docstring under it; "
                                        "a PREFIX (a section such as actor.optim, or one key) lists only those.")
    config.add_argument("--trainer", choices=tuple(TRAINERS), default="train",
                        help="the command whose config is listed (default: %(default)s, the RL trainer)")
    config.add_argument("prefix", nargs="?", default="", metavar="PREFIX",
                        help="a section or key, e.g. actor.optim (default: every key)")


def config_main(args: argparse.Namespace) -> int:
    """`shardrl config [--trainer NAME] [PREFIX]`: the config's keys, defaults and docstrings (no torch import)."""
    from shardrl.config.docs import describe_keys, format_keys

    print(format_keys(describe_keys(TRAINERS[args.trainer].config, args.prefix)))
    return 0


def plot_main(args: argparse.Namespace) -> int:
    from shardrl.trainer.plot import plot_main as run

    return run(args) or 0


COMMANDS = {"plan": plan_main, "doctor": doctor_main, "train": train_main, "plot": plot_main, "serve": serve_main,
            "config": config_main,
            **{name: train_main for name, trainer in TRAINERS.items() if trainer.offline}}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides may follow options (`plan run.yaml --nnodes 2 rollout.n=8`); argparse leaves those unknown
    args, unknown = parser.parse_known_args(argv)
    if unknown and (not hasattr(args, "args") or any("=" not in u or u.startswith("-") for u in unknown)):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "args"):
        args.args += unknown
        _split_config_args(args)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as e:  # the user's mistake (ConfigError included): no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        import errno

        from shardrl.launch.signals import STORAGE_EXIT, is_storage_error

        if e.errno in (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR):  # a path the user gave: said so
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not is_storage_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)  # disk full / read-only: the message names the path
        return STORAGE_EXIT
    except KeyboardInterrupt:  # Ctrl-C before a command's own handlers are set (its imports, a download)
        from shardrl.launch.signals import INTERRUPTED_EXIT

        print(f"interrupted (Ctrl-C) while shardrl {args.command} started; nothing ran", file=sys.stderr)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
