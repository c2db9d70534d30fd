"""Our CLI in one torchrun worker, then this process's own peak RSS to ``$PEAK_DIR/rank-$RANK.json``.

``children.run_child`` measures one child (torchrun itself); each worker of a
multi-process run reports its own high-water mark (``VmHWM``) this way.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import own_peak_rss_bytes  # noqa: E402


def main() -> int:
    from maxent_grpo.cli import main as cli_main

    code = cli_main(sys.argv[1:])
    out = Path(os.environ["PEAK_DIR"]) / f"rank-{os.environ['RANK']}.json"
    out.write_text(json.dumps({"peak_rss_bytes": own_peak_rss_bytes()}))
    return code


if __name__ == "__main__":
    sys.exit(main())
