"""``astraflow up``: run directory, embedded server, supervised role processes, live view, report."""

from astraflow.launch.up import RunFailed, new_run_dir, up

__all__ = ["RunFailed", "new_run_dir", "up"]
