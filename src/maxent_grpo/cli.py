"""Command line: ``maxent-grpo train | eval | report``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from maxent_grpo.errors import UserError
from maxent_grpo.config.load import ConfigError
from maxent_grpo.config.help import field_help

DESCRIPTION = """\
GRPO and maximum-entropy GRPO fine-tuning of language models.

commands:
  train    train a policy from a YAML recipe (or the built-in default)
  eval     pass@k, mean@k and distinct answers of a model or checkpoint on a task
  report   PNG plots and an HTML page for one or more run directories
"""


def _config_epilog() -> str:
    lines = ["config keys (set in the YAML file or with --set KEY=VALUE):"]
    for key, type_name, default, text in field_help():
        lines.append(f"  {key}  [{type_name}, default {default}]")
        lines.append(f"      {text}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maxent-grpo", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _train_parser(sub)
    _eval_parser(sub)
    _serve_parser(sub)
    rep = sub.add_parser("report", help="plots and an HTML page for runs", description="Plot one run, or overlay several.")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rep.add_argument("--out", metavar="DIR", help="output folder (default: RUN_DIR/report, or ./report for several runs)")
    return parser


def _train_parser(sub) -> None:
    train = sub.add_parser(
        "train", help="train a policy", epilog=_config_epilog(),
        description="Train a policy with GRPO or a MaxEnt variant. With no --config, runs the built-in "
        "default: SmolLM2-135M-Instruct on reasoning-gym chain_sum with MaxEnt listwise weights.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", metavar="FILE", help="YAML recipe (see recipes/); default: the built-in default")
    train.add_argument(
        "--from-trl", metavar="FILE",
        help="a TRL GRPO YAML (the file of trl grpo --config) instead of --config: each field mapped, "
        "refused or ignored as docs/TRL.md's table says",
    )
    train.add_argument("--output-dir", metavar="DIR", help="where metrics, completions and checkpoints go (logging.output_dir)")
    train.add_argument("--max-steps", type=int, metavar="N", help="number of optimizer steps (training.max_steps)")
    train.add_argument("--seed", type=int, metavar="S", help="random seed (training.seed)")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any config key, dotted for nested sections, e.g. --set loss.beta=0.04; repeatable",
    )
    train.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="PATH|auto",
        help="continue from a checkpoint: PATH; auto (also with no value): the latest complete one in the "
        "output dir, or start afresh when there is none (one command line for the first start and every "
        "restart, e.g. under torchrun --max-restarts)",
    )
    train.add_argument(
        "--overwrite", action="store_true",
        help="delete a previous run in the output dir first (without it such a folder is refused)",
    )
    train.add_argument(
        "--allow-config-change", action="store_true",
        help="with --resume: accept changed settings such as the learning rate (recorded in config.yaml)",
    )
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval", help="evaluate a model or checkpoint", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""Sample K completions per prompt (plus one greedy) and write
DIR/summary.json (pass@1 and pass@K with the unbiased estimator, mean@K, distinct@K,
greedy_pass@1, num_prompts, model, deciding_reward) and DIR/completions.jsonl.

A completion is correct when the FIRST reward function of the config gives >= 1.0
(list an accuracy reward first); the other rewards are recorded but never decide, and
None counts as wrong. distinct@K counts distinct correct final answers (last \\boxed{}
or <answer>, canonicalised). Prompts: the run's held-out split when data.eval_size > 0;
else, for reasoning_gym sources, problems generated from another seed that the run did
not train on (with MODEL = RUN/checkpoints/step-N: that its sampler had not drawn by step
N), or, when it trained on every problem the task has, those, with a warning; else the
first N rows of data.source, with a warning for those the run trained on. With --config
RUN/config.yaml and MODEL = RUN/checkpoints/step-N it reproduces RUN/eval/step-N exactly.
On ModeBench rows summary.json adds ModeBench's mb/ metrics over eval.draws groups of K per
prompt (4 groups of 8 on modebench_pkg data); an answer its verifier cannot score voids every metric.""",
    )
    ev.add_argument("model", help="model name or path, or a checkpoint folder")
    ev.add_argument("--config", metavar="FILE", help="recipe whose data, rewards and generation settings to use")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override config keys")
    ev.add_argument("--num-prompts", type=int, default=None, metavar="N", help="prompts to evaluate (eval.num_prompts)")
    ev.add_argument("-k", type=int, default=None, help="samples per prompt (eval.k)")
    ev.add_argument("--output", metavar="DIR", required=True, help="folder for summary.json and completions.jsonl")


def _serve_parser(sub) -> None:
    srv = sub.add_parser(
        "serve", help="start a vLLM server for generation.backend: vllm_server",
        description="Start vLLM's OpenAI-compatible server with the flags the vllm_server backend needs "
        "(processed log-probs, the weight-reload endpoints). Arguments after -- go to vLLM unchanged, "
        "e.g. -- --tensor-parallel-size 2 --gpu-memory-utilization 0.9.",
    )
    srv.add_argument("model", help="model name or path (smollm2-135m-instruct for the packaged model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--dtype", default="auto", help="engine dtype: auto, float32, bfloat16, float16")
    srv.add_argument("--cpu-kv-cache-gib", type=int, default=None, metavar="GIB",
                     help="vLLM's CPU build: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); default: the variable, "
                     "else 2 when no GPU is visible")
    srv.add_argument("--lora-rank", type=int, default=None, metavar="R",
                     help="plan the server for LoRA adapters of rank R, loaded at run time "
                     "(generation.vllm.lora_sync: adapter; R = model.lora.r)")
    srv.add_argument("--reload-mode", choices=("layerwise", "direct"), default="layerwise",
                     help="how a weight push writes the server's weights (direct: vLLM >= 0.34, in place)")
    srv.add_argument("--lm-head-fp32", action="store_true",
                     help="the LM head's matmul in float32 (vLLM's head_dtype), for model.lm_head_fp32")
    srv.add_argument("--print-command", action="store_true", help="print the command instead of running it")


def _train(args) -> int:
    from maxent_grpo.config.load import load_config, to_dict

    overrides = list(args.set)
    if args.output_dir:
        overrides.append(f"logging.output_dir={args.output_dir}")
    if args.max_steps is not None:
        overrides.append(f"training.max_steps={args.max_steps}")
    if args.seed is not None:
        overrides.append(f"training.seed={args.seed}")
    if args.resume is not None and args.overwrite:
        raise ConfigError("--resume and --overwrite: choose one (continue the run, or delete it)")
    if args.from_trl is not None:
        if args.config is not None:
            raise ConfigError("--config and --from-trl: give one (a config of ours, or a TRL GRPO YAML)")
        from maxent_grpo.config.trl import load_trl_config

        cfg, notes = load_trl_config(args.from_trl, overrides)
        if _is_main_process():
            for note in notes:
                print(f"maxent-grpo: from TRL: {note}", file=sys.stderr)
    else:
        cfg = load_config(args.config, overrides)
    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.training.precision import Machine

    # Compiled once, here: below this line the run reads the plan, and the config is data it saves.
    plan = compile_run(cfg, Machine.here())
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    from maxent_grpo.training.interrupt import RunInterrupted
    from maxent_grpo.training.loop import train
    from maxent_grpo.training.summary import format_summary

    try:
        summary = train(plan, resume=args.resume, overwrite=args.overwrite, allow_config_change=args.allow_config_change)
    except RunInterrupted as stopped:
        # The checkpoint is written: one more Ctrl-C must not turn the exit code into a crash.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if _is_main_process():
            print(f"maxent-grpo: {stopped}", file=sys.stderr)
            if stopped.checkpoint is not None:
                print(f"resume with: {_resume_command(args.argv)}", file=sys.stderr)
        return 130
    if _is_main_process():
        print(format_summary(summary, config_path=summary.output_dir / "config.yaml"))
    return 0


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _resume_command(argv: list[str]) -> str:
    """The command that was run, with ``--resume`` (and without ``--overwrite``)."""
    import shlex

    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--overwrite" or arg.startswith("--resume="):
            continue
        if arg == "--resume":
            # --resume takes an optional PATH: drop it too when one follows.
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")
            continue
        kept.append(arg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun --nproc_per_node {world} -m maxent_grpo.cli" if world > 1 else "maxent-grpo"
    return f"{launcher} {shlex.join(kept + ['--resume'])}"


def _eval(args) -> int:
    from maxent_grpo.eval_command import run_eval
    from maxent_grpo.config.load import load_config
    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.training.precision import Machine

    return run_eval(compile_run(load_config(args.config, args.set), Machine.here(training=False)), args)


def _report(args) -> int:
    from maxent_grpo.report import main_report

    out = main_report(args.run_dirs, args.out)
    print(f"report: {out}")
    return 0


def _serve(args) -> int:
    import shlex

    import torch

    from maxent_grpo.models import resolve_model_path
    from maxent_grpo.rollout.vllm_server import DEFAULT_CPU_KV_CACHE_GIB, server_command

    kv_gib = args.cpu_kv_cache_gib
    if kv_gib is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not torch.cuda.is_available():
        kv_gib = DEFAULT_CPU_KV_CACHE_GIB
    cmd, env = server_command(
        resolve_model_path(args.model), host=args.host, port=args.port, dtype=args.dtype, extra=args.vllm_args,
        cpu_kv_cache_gib=kv_gib, lora_rank=args.lora_rank, head_fp32=args.lm_head_fp32, reload_mode=args.reload_mode,
    )
    if args.print_command:
        shown = {k: env[k] for k in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_RELOAD_MODE",
                                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING") if k in env}
        print(" ".join(f"{k}={v}" for k, v in shown.items()) + " " + shlex.join(cmd))
        return 0
    os.execvpe(cmd[0], cmd, env)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" goes to vLLM's server unchanged (serve only).
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if passthrough and args.command != "serve":
        parser.error("arguments after -- are only taken by serve")
    args.vllm_args, args.argv = passthrough, argv
    if args.command is None:
        parser.print_help()
        return 2
    # Every process meets the same warnings; the main one speaks for all.
    level = os.environ.get("MAXENT_GRPO_LOG", "INFO") if _is_main_process() else "ERROR"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # bitsandbytes, imported through transformers/peft, warns on CPUs with AVX-512 bf16 that its optional
    # 4-bit CPU kernel cannot be fetched from the hub; nothing here runs 4-bit matmuls on the CPU.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    handler = {"train": _train, "eval": _eval, "report": _report, "serve": _serve}[args.command]
    if os.environ.get("MAXENT_GRPO_DEBUG"):
        return handler(args)  # full tracebacks
    # Bad input and the machine's refusals (disk full, permissions) get one line; any other
    # exception is a bug and keeps its traceback.
    try:
        return handler(args)
    except ConfigError as err:
        print(f"maxent-grpo: config error: {err}", file=sys.stderr)
        return 2
    except UserError as err:
        print(f"maxent-grpo: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"maxent-grpo: error: {_os_error_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("maxent-grpo: interrupted", file=sys.stderr)
        return 130


def _os_error_line(err: OSError) -> str:
    where = f": {err.filename}" if err.filename else ""
    return f"{err.strerror or err}{where}"


if __name__ == "__main__":
    sys.exit(main())
