"""A Python with mosaicml-streaming, beside the project's own environment.

mosaicml-streaming 0.13 (the newest release) pins transformers<5 and numpy<2.2, so it cannot be
installed next to the core stack. The interop tests run mosaic's own MDSWriter and StreamingDataset
in a venv of their own: ``$PIPELINES_MOSAIC_PYTHON`` when set, else ``<repo>/.venv-mosaic``, made on
first use (``python -m venv`` + ``pip install mosaicml-streaming``, plus pydantic and pyyaml so the
benchmarks' mosaic peers can use this project's record formatting from the source tree; a few minutes,
once per clone). The whole suite makes it in the background while other tests run (tests/conftest.py);
the benchmarks run their mosaic peers with it (``python tests/mosaic_venv.py`` prints its path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-mosaic"
REQUIREMENTS = ["mosaicml-streaming>=0.13,<0.14", "pydantic>=2.7,<3", "pyyaml>=6"]


def mosaic_python() -> Path:
    """The interpreter to run mosaic's code with, made if needed; RuntimeError with pip's output if it fails."""
    given = os.environ.get("PIPELINES_MOSAIC_PYTHON")
    if given:
        return Path(given)
    python = VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import streaming, pydantic, yaml"],
                                          capture_output=True).returncode == 0:
        return python
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(VENV / "bin" / "pip"), "install", "-q", *REQUIREMENTS]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
        if proc.returncode != 0:
            raise RuntimeError(f"making the mosaic venv failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return python


def mosaic_read(python: Path, locations: list[str], validate_hash: str | None = None) -> dict[str, list[dict]]:
    """Every sample of each MDS set at ``locations`` (directories or ``s3://`` URLs; S3 through mosaic's
    boto3 client, which reads ``S3_ENDPOINT_URL`` and the AWS variables of this process) as mosaic's
    ``StreamingDataset`` returns it, in the plain form of tests/fixtures/mds/samples.py."""
    import json

    cmd = [str(python), str(ROOT / "tests" / "fixtures" / "mds" / "read_with_mosaic.py"), *map(str, locations)]
    if validate_hash:
        cmd += ["--validate-hash", validate_hash]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"mosaic's StreamingDataset failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(mosaic_python())
