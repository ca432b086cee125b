"""Weights specs: the weights a command is told to start from or evaluate, parsed once.

    <run dir>                  this project's run directory (its checkpoint.pth)
    <file>                     a torch checkpoint or .safetensors file (what it may hold: resmlp.models.load)
    timm:<name>                timm's model <name> with its pretrained weights
    timm:<name>?random         the same architecture with random weights (no download)
    timm:<name>?pretrained     its pretrained weights, whatever the command asks for by default

`WeightsSpec.parse` reads what the command line or a config key gave (`checkpoint`,
`dino.init`, `distill.teacher`); every command that takes weights hands the parsed spec on
(resmlp.models.load reads it). This is the one module that knows how a timm spec is spelled:
messages that suggest one build it with `timm_spec`.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from resmlp.core.checkpoint import CHECKPOINT_NAME, PREVIOUS_NAME, resolve_checkpoint_path, saved_config
from resmlp.core.errors import UserError

_PREFIX = "timm:"
FLAGS = ("", "random", "pretrained")   # "": the command's default (pretrained, unless it says otherwise)


def timm_spec(name: str, flag: str = "") -> str:
    """The spec of timm's model `name` (with `?flag`), as a user types it."""
    return f"{_PREFIX}{name}" + (f"?{flag}" if flag else "")


# The forms a spec takes, for usage lines and for messages that say what to pass.
FORMS = f"<checkpoint | run dir | {timm_spec('<name>')}>"
ANY = f"a checkpoint file, a run dir or {timm_spec('<name>')}"


def names_timm(text) -> bool:
    """Whether `text` names timm weights rather than a file (a config value made absolute
    or not)."""
    return isinstance(text, str) and text.startswith(_PREFIX)


@dataclass(frozen=True)
class WeightsSpec:
    """A parsed spec. `timm_name` is set for timm:<name> (with its `flag`), else the spec is
    a path (`path`, as given, user folder expanded); the file behind it is `file`."""
    text: str
    timm_name: str | None = None
    flag: str = ""

    @classmethod
    def parse(cls, text) -> WeightsSpec:
        """A spec from a string or path; a WeightsSpec is returned as it is. A timm spec's
        flag is checked here; whether a file exists, when `file` is asked for."""
        if isinstance(text, WeightsSpec):
            return text
        if text is None or not str(text).strip():
            raise UserError(f"no weights given: pass {ANY}")
        text = os.fspath(text) if isinstance(text, os.PathLike) else str(text)
        if not names_timm(text):
            return cls(text)
        name, _, flag = text[len(_PREFIX):].partition("?")
        if flag not in FLAGS:
            raise UserError(f"{text}: unknown flag ?{flag}; use {timm_spec('<name>')} or "
                            f"{timm_spec('<name>', 'random')}")
        return cls(text, name, flag)

    def __str__(self) -> str:
        return self.text

    @property
    def is_timm(self) -> bool:
        return self.timm_name is not None

    @property
    def plain(self) -> str:
        """timm:<name> without its flag (a path spec: as given)."""
        return timm_spec(self.timm_name) if self.is_timm else self.text

    def pretrained(self, default: bool) -> bool:
        """Whether timm's pretrained weights are asked for: the flag's word, else `default`."""
        return self.flag == "pretrained" if self.flag else default

    @property
    def path(self) -> Path | None:
        """The path given (None for timm), not checked."""
        return None if self.is_timm else Path(self.text).expanduser()

    @property
    def file(self) -> Path:
        """The checkpoint file (a run dir's checkpoint.pth); a UserError when there is none."""
        if self.is_timm:
            raise UserError(f"{self.text} names timm's weights, not a checkpoint file")
        return resolve_checkpoint_path(self.text, alternatives=ANY)

    @property
    def key(self) -> str:
        """What config.yaml keeps: a timm spec as given, a path as the absolute path of its
        checkpoint file (a run dir's checkpoint.pth), whether or not it exists now."""
        if self.is_timm:
            return self.text
        path = self.path.resolve()
        return str(path / CHECKPOINT_NAME if path.is_dir() else path)

    @property
    def name(self) -> str:
        """A short name of these weights, for a folder's name: the model for timm (its flag
        dropped), the run's name for a run dir or a checkpoint in one (its checkpoint.pth or
        checkpoint_prev.pth), the file's stem for another file."""
        if self.is_timm:
            name = self.timm_name
        else:
            path = self.path
            name = path.parent.name if path.name in (CHECKPOINT_NAME, PREVIOUS_NAME) else \
                path.name if path.is_dir() or not path.suffix else path.stem
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "weights"

    def identity(self) -> dict | None:
        """What these weights are, to tell whether a run that started from this spec started
        from the same weights (core.run_folder: a run folder belongs to its inputs): timm's spec as
        given for timm (the name is the weights); for a path, the checkpoint file read
        (`key`), its size and the sha256 of its bytes, so a file retrained or replaced in
        place is another input. None: no file there now (the loader names what is missing)."""
        if self.is_timm:
            return {"timm": self.text}
        try:
            file = self.file
            return {"file": self.key, "bytes": file.stat().st_size, "sha256": _sha256(file)}
        except (UserError, OSError):
            return None

    def saved_config(self) -> dict | None:
        """The config this project's checkpoint or run dir was trained with (None: timm's,
        or a file without one). A run dir may keep it in config.yaml; a missing file is named
        as `file` names it."""
        if self.is_timm:
            return None
        return saved_config(self.text if self.path.is_dir() else self.file)


def _sha256(path) -> str:
    """The file's sha256, the whole file each time it is asked (a run checks or records it once):
    it costs a fraction of the torch.load that reads the same bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


__all__ = ["ANY", "FLAGS", "FORMS", "WeightsSpec", "names_timm", "timm_spec"]
