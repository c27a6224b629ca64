"""What every results row records about where it was measured: the tree (commit) and the GPU. One home for the
benchmarks here and bench/serve_gpu. A device copy of the tree carries stale git metadata, so scripts run there take
the commit from --commit (given by whoever starts the sitting) and fall back to git."""
from __future__ import annotations

import subprocess


def git_commit(cwd: str | None = None) -> str:
    """HEAD's short hash, marked when tracked files differ from it; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=cwd).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=cwd).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
