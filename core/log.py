"""A run's log: log.jsonl (one JSON line a record) and TensorBoard's scalars, written by
rank 0. Its own file because it knows files and steps, not runs: `Run` (core/run.py) opens
it, and a checkpoint keeps its size so that a resumed run cuts it back (rewind). log.jsonl
is opened without following a link (core/files.py: a run folder from elsewhere may hold one
to a file outside it), and TensorBoard's folder is refused when it is a link.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from resmlp.core.files import open_nofollow, refuse_link


class JsonlLogger:
    """log.jsonl plus TensorBoard scalars, written by rank 0 only."""

    def __init__(self, directory: Path | None, fresh: bool = False):
        """fresh: a run that starts at iteration 0, whose directory may hold the logs of an
        earlier start stopped before its first checkpoint: log.jsonl starts empty, and
        TensorBoard hides their events (a purge from step 0)."""
        self.file = None
        self.tb = None
        self.directory = directory
        if directory is None:
            return
        refuse_link(directory / "tb")
        self.file = open_nofollow(directory / "log.jsonl", "w" if fresh else "a", buffering=1)
        self._open_tb(purge_step=0 if fresh and any((directory / "tb").glob("events.*")) else None)

    def _open_tb(self, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.directory / "tb"), purge_step=purge_step)
        except ImportError:  # TensorBoard is optional at run time
            self.tb = None

    def size(self) -> int | None:
        """Bytes of log.jsonl written so far (a checkpoint keeps it: see rewind)."""
        if self.file is None:
            return None
        self.file.flush()
        return os.fstat(self.file.fileno()).st_size

    def rewind(self, size: int | None, step: int) -> None:
        """Back to the log as it was when a checkpoint was saved: log.jsonl cut to `size`
        bytes and TensorBoard's events after `step` hidden, since the resumed run logs the
        iterations after the checkpoint again (each is then in the log once)."""
        if self.file is None or size is None:
            return
        if self.size() > size:
            os.ftruncate(self.file.fileno(), size)  # append mode: the next line goes at the new end
        if self.tb is not None:
            self.tb.close()
            self._open_tb(purge_step=step + 1)

    def write(self, record: dict, step: int | None = None) -> None:
        if self.file is None:
            return
        record = {k: (float(v) if isinstance(v, (np.floating, torch.Tensor)) else v)
                  for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None and step is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("epoch", "iteration"):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
