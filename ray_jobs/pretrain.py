"""Pretraining / continued pretraining job: ``python ray_jobs/pretrain.py [--config X] [key=value ...]``.

Same as sft.py with other defaults: configs/pretrain.yaml (plain-text JSONL, ``concat`` packing:
documents joined with EOS and cut into full rows, every token trained).
"""

from __future__ import annotations

import sys

from _common import REPO_ROOT, main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], REPO_ROOT / "configs" / "pretrain.yaml", __doc__.splitlines()[0]))
