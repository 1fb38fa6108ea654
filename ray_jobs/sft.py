"""Supervised fine-tuning job: ``python ray_jobs/sft.py [--config X] [key=value ...]``.

With no arguments it runs the embedded default (configs/default.yaml: a tiny Llama learns the demo
word games on 2 CPU workers). On a cluster::

    ray job submit --working-dir . -- python ray_jobs/sft.py --config configs/<name>.yaml scaling.num_workers=8
"""

from __future__ import annotations

import sys

from _common import REPO_ROOT, main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], REPO_ROOT / "configs" / "default.yaml", __doc__.splitlines()[0]))
