"""Images nobody labeled: `data=folder data.root=DIR` (every image file under DIR, at any
depth) or `data.files=LIST` (a text file of image paths, one a line). Also the one way
image files are found and held, which labeled image folders (imagefolder.py) build on.

Finding the files (`scan_folder`), with `os.scandir`:
- an image is a file with an extension of images.IMG_EXTENSIONS, in any case (.JPG, .Png);
- hidden entries (a name starting with '.') are skipped, a hidden folder with all it holds;
  so are other files (no image extension: README.txt, a photo saved without `.jpg`),
  broken links and special files: each skipped entry is counted by reason and the first
  few are named (`Skipped`), which `run.sh data` prints;
- symlinks are followed, each folder entered once: a link to a folder already scanned (a
  loop, or a second way into the same folder) is skipped and counted. Real folders are
  scanned before linked ones, so a folder reached both ways is listed under its own path;
- the paths are sorted: the same folder gives the same order on every machine.

`data.files=LIST`: one path a line (blank lines and lines starting with '#' skipped),
absolute or relative to data.root (to the list's own folder when data.root is not set);
taken as listed, whatever their extension; a path listed twice counts once; any missing
path stops the command before any work, naming the first and how many are missing.

A million files on shared storage must not be scanned at every start or requeue:
`FileLists` keeps a run's scans. The trainer gives it the run dir: a resumed or requeued
run reads the list saved there (LISTING, checked against the root, the list file and the
number of paths it was made from) instead of scanning again; a fresh run scans once, on
rank 0 (the other ranks receive its result), and writes the list once the run dir
exists. The unreadable images data.skip_corrupt found are saved with it, so they are not
opened again either.
"""
from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from resmlp.core import dist
from resmlp.core.errors import UserError
from resmlp.data.decode import read_encoded
from resmlp.data.images import IMG_EXTENSIONS, find_unreadable, is_image_file, load_rgb
from resmlp.data.paths import user_root

LISTING = "folder_files.jsonl"   # in the run dir: the scan a resumed run reads back
NAMED = 20                       # skipped entries named per reason (all are counted)
_USAGE = ("data=folder reads every image under data.root=DIR at any depth, or the paths listed "
          "in data.files=LIST (one a line)")


# --------------------------------------------------------------------------- what is skipped

@dataclass
class Skipped:
    """Entries a scan did not take, counted by reason, the first NAMED of each named."""
    counts: collections.Counter = field(default_factory=collections.Counter)
    names: dict = field(default_factory=dict)

    def add(self, reason: str, path: str) -> None:
        self.counts[reason] += 1
        named = self.names.setdefault(reason, [])
        if len(named) < NAMED:
            named.append(path)

    def merge(self, other: "Skipped") -> "Skipped":
        for reason, n in other.counts.items():
            self.counts[reason] += n
            self.names[reason] = (self.names.get(reason, []) + other.names.get(reason, []))[:NAMED]
        return self

    def total(self) -> int:
        return sum(self.counts.values())

    def lines(self) -> list[str]:
        """One line per reason: '<n> <reason>: <names>[, ... and <m> more]'."""
        out = []
        for reason, n in sorted(self.counts.items()):
            named = self.names.get(reason, [])
            more = f", ... and {n - len(named)} more" if n > len(named) else ""
            out.append(f"{n} {reason}: {', '.join(named)}{more}")
        return out

    def to_dict(self) -> dict:
        return {"counts": dict(self.counts), "names": self.names}

    @classmethod
    def from_dict(cls, d: dict) -> "Skipped":
        return cls(collections.Counter(d.get("counts", {})), dict(d.get("names", {})))


NOT_IMAGE = "files without an image extension (not read; an image saved without one needs its extension)"
HIDDEN = "hidden entries (names starting with '.')"
LOOP = "links to a folder already scanned (followed once)"
BROKEN = "broken links"
SPECIAL = "special files (not regular files)"
UNLISTABLE = "folders that cannot be listed"
TWICE = "paths listed twice (read once)"


# --------------------------------------------------------------------------- finding files

@dataclass
class Scan:
    """What a scan found: `paths` (sorted, absolute) and what it `skipped`; `unreadable`
    [(path, reason)] once data.skip_corrupt has opened the images (those are then out of
    `paths`)."""
    root: str
    files: str | None
    paths: list[str]
    skipped: Skipped
    unreadable: list | None = None


def scan_folder(root: str) -> Scan:
    """Every image file under `root`, any depth (the rules in the module docstring)."""
    paths, skipped = [], Skipped()
    seen = set()
    real, links = [root], []   # folders to list: real ones first, then those reached by a link
    while real or links:
        folder = real.pop() if real else links.pop()
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:
                skipped.add(LOOP, folder)
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name, reverse=True)
        except OSError:
            skipped.add(UNLISTABLE, folder)
            continue
        for e in entries:
            if e.name.startswith("."):
                skipped.add(HIDDEN, e.path)
            elif e.is_dir():                      # follows links
                (links if e.is_symlink() else real).append(e.path)
            elif e.is_file():
                if is_image_file(e.name):
                    paths.append(e.path)
                else:
                    skipped.add(NOT_IMAGE, e.path)
            elif e.is_symlink():
                skipped.add(BROKEN, e.path)
            else:
                skipped.add(SPECIAL, e.path)
    paths.sort()
    return Scan(root, None, paths, skipped)


def read_file_list(list_path: str, root: str | None) -> Scan:
    """The paths of a data.files list, checked to exist (one UserError naming the first
    missing one and how many are missing)."""
    base = root or os.path.dirname(list_path)
    try:
        with open(list_path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UserError(f"data.files={list_path} cannot be read ({e.strerror}); give a text file of "
                        "image paths, one a line") from None
    paths, skipped, missing, first = set(), Skipped(), 0, None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(base, os.path.expanduser(line)))
        if not os.path.isfile(path):
            missing += 1
            first = first or (number, line, path)
        elif path in paths:
            skipped.add(TWICE, path)
        else:
            paths.add(path)
    if missing:
        number, line, path = first
        where = "" if os.path.isabs(line) else f" (relative to {base})"
        raise UserError(f"data.files={list_path}: {missing} listed path(s) are not files, the first on line "
                        f"{number}: {path}{where}; fix or remove those lines")
    if not paths:
        raise UserError(f"data.files={list_path} lists no image paths; {_USAGE}")
    return Scan(root or base, list_path, sorted(paths), skipped)


def screen(paths: list[str], where: str, skip_corrupt: bool, check: bool,
           shared: bool = True) -> list[tuple[str, str]]:
    """With data.skip_corrupt or data.check: open every image once and return the unreadable
    [(path, reason)]; any is a UserError unless skip_corrupt. shared: every rank calls this,
    rank 0 opens the files and hands the result to the others; False: this process alone
    (FileLists' rank 0, which hands over the whole scan)."""
    if not (skip_corrupt or check):
        return []
    if dist.is_main():
        print(f"data: opening all {len(paths)} images under {where} to find unreadable ones", flush=True)
    if shared:
        bad = dist.broadcast_object(find_unreadable(paths) if dist.is_main() else None)
    else:
        bad = find_unreadable(paths)
    if bad and not skip_corrupt:
        path, reason = bad[0]
        raise UserError(f"{len(bad)} unreadable image(s) under {where}, the first {path} ({reason}); "
                        f"fix or delete them or set data.skip_corrupt=true "
                        f"(`run.sh data data.check=true` lists them all)")
    if skip_corrupt and dist.is_main():
        print(f"data: skipped {len(bad)} unreadable image(s) under {where} (data.skip_corrupt=true)", flush=True)
    return bad


def folder_root(data_cfg) -> tuple[str | None, str | None]:
    """(data.root, data.files) as absolute paths, checked to be a folder and a file."""
    root, files = user_root(data_cfg), data_cfg.get("files", None)
    if files:
        files = os.path.abspath(os.path.expanduser(str(files)))
        if not os.path.isfile(files):
            raise UserError(f"data.files={files} is {'a folder' if os.path.isdir(files) else 'not there'}; "
                            "give a text file of image paths, one a line")
    if root is None and not files:
        raise UserError(f"data.root is not set; {_USAGE}")
    if root is not None and not os.path.isdir(root):
        raise UserError(f"data.root={root} is {'a file' if os.path.exists(root) else 'not there'}; "
                        f"give the folder that holds the images ({_USAGE})")
    return root, files


def find(data_cfg, shared: bool = True) -> Scan:
    """The images data.root / data.files names, screened as data.skip_corrupt / check ask
    (shared: as `screen`'s)."""
    root, files = folder_root(data_cfg)
    scan = read_file_list(files, root) if files else scan_folder(root)
    where = files or root
    if not scan.paths:
        raise UserError(f"no images under data.root={root} (looked for {' '.join(IMG_EXTENSIONS)} at any "
                        f"depth; skipped {scan.skipped.total()} other entries); {_USAGE}")
    bad = screen(scan.paths, where, bool(data_cfg.skip_corrupt), bool(data_cfg.check),
                 shared)
    if bad and data_cfg.skip_corrupt:
        drop = {p for p, _ in bad}
        scan.paths = [p for p in scan.paths if p not in drop]
        if not scan.paths:
            raise UserError(f"every image under {where} is unreadable; {_USAGE}")
    scan.unreadable = bad
    return scan


# --------------------------------------------------------------------------- a run's scans

def _listing_header(scan: Scan, skip_corrupt: bool) -> dict:
    return {"root": scan.root, "files": scan.files, "count": len(scan.paths), "skip_corrupt": skip_corrupt,
            "skipped": scan.skipped.to_dict(), "unreadable": scan.unreadable}


def save_listing(scan: Scan, directory: Path, skip_corrupt: bool) -> Path:
    """The scan as `directory`/LISTING: a JSON header, then one JSON string per path
    (relative to the root where it lies under it): any file name survives the round trip."""
    from resmlp.core.checkpoint import atomic_write
    path = Path(directory) / LISTING
    prefix = scan.root.rstrip(os.sep) + os.sep
    with atomic_write(path, "w", what="the folder's file list") as fh:
        fh.write(json.dumps(_listing_header(scan, skip_corrupt)) + "\n")
        for p in scan.paths:
            fh.write(json.dumps(p[len(prefix):] if p.startswith(prefix) else p) + "\n")
    return path


def load_listing(directory: Path, root: str, files: str | None, skip_corrupt: bool) -> tuple[Scan | None, str]:
    """(the scan saved in `directory`, '') when it was made from this root and list and holds
    the number of paths it says; else (None, why not)."""
    path = Path(directory) / LISTING
    if not path.is_file():
        return None, "no saved list"
    try:
        with open(path, encoding="utf-8") as f:
            head = json.loads(f.readline())
            rel = json.loads("[" + ",".join(f.read().splitlines()) + "]")   # one parse, not one per line
    except (OSError, ValueError) as e:
        return None, f"{path} cannot be read ({e})"
    made = (head.get("root"), head.get("files"), bool(head.get("skip_corrupt")))
    if made != (root, files, skip_corrupt):
        return None, f"{path} was made from data.root={made[0]} data.files={made[1]} skip_corrupt={made[2]}"
    if len(rel) != head.get("count"):
        return None, f"{path} holds {len(rel)} paths where it was made with {head.get('count')}"
    prefix = root.rstrip(os.sep) + os.sep
    paths = [p if os.path.isabs(p) else prefix + p for p in rel]
    return Scan(root, files, paths, Skipped.from_dict(head.get("skipped", {})), head.get("unreadable")), ""


class FileLists:
    """The file lists (data=folder) of one run: `get` reads the one saved in the run dir, or
    scans once (rank 0 under torchrun: call it on every rank), and `save` writes what was
    scanned into the run dir once it exists. Without a directory it only keeps each scan
    for the process's later builds."""

    def __init__(self, directory=None):
        self.directory = Path(directory) if directory is not None else None
        self.scans: dict = {}
        self.fresh: dict = {}     # scanned in this process: to be saved
        self.scan_count = 0       # scans made (the tests count them)

    def get(self, data_cfg) -> Scan:
        root, files = folder_root(data_cfg)
        skip = bool(data_cfg.skip_corrupt)
        key = (root, files, skip)
        if key in self.scans:
            return self.scans[key]
        result = None
        if dist.is_main():
            try:
                scan, why = (load_listing(self.directory, root or "", files, skip) if self.directory is not None
                             else (None, ""))
                if scan is None:
                    if self.directory is not None and why != "no saved list":
                        print(f"data: scanning again: {why}", flush=True)
                    scan = find(data_cfg, shared=False)   # rank 0 alone: the others wait below
                    self.scan_count += 1
                    self.fresh[key] = scan
                else:
                    print(f"data: {len(scan.paths)} images from the list saved in {self.directory / LISTING} "
                          "(not scanned again)", flush=True)
                result = ("ok", scan)
            except UserError as e:
                result = ("error", str(e))
        kind, value = dist.broadcast_object(result)
        if kind == "error":
            raise UserError(value)
        self.scans[key] = value
        return value

    def save(self) -> None:
        """Write each list scanned in this process into the run dir (rank 0), once."""
        if self.directory is None or not dist.is_main():
            self.fresh.clear()
            return
        for (_, _, skip), scan in self.fresh.items():
            save_listing(scan, self.directory, skip)
        self.fresh.clear()


# --------------------------------------------------------------------------- the datasets

class ImageFiles(torch.utils.data.Dataset):
    """Image files with a label each (-1: none), yielding (transform(RGB PIL image), label).

    Attributes: `classes`, `targets` (int64 array), `samples` [(path, label)], `skipped`
    (a Skipped: entries not taken), `unreadable` [(path, reason)] (left out by
    data.skip_corrupt), `source`. Paths are kept in one numpy bytes array, not a list of
    Python strings, so forked loader workers share them instead of copying them page by
    page (a list of 1.28M strings is touched by refcounting and the GC).
    """

    def __init__(self, paths: list[str], targets, classes: list[str], transform=None, source: str = "",
                 skipped: Skipped | None = None, unreadable=None):
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.transform = transform
        self._paths = np.array([os.fsencode(p) for p in paths], dtype=bytes)
        self.targets = np.asarray(targets, dtype=np.int64).reshape(-1)
        self.skipped = skipped if skipped is not None else Skipped()
        self.unreadable = list(unreadable or [])
        # True: yield the files' bytes (decode.EncodedImage) for a transform that decodes
        # them itself (serve_encoded); False: decoded RGB PIL images.
        self.encoded = False
        self.source = source

    @property
    def samples(self) -> list[tuple[str, int]]:
        return [(os.fsdecode(p), int(y)) for p, y in zip(self._paths, self.targets)]

    def path(self, index: int) -> str:
        return os.fsdecode(self._paths[index])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        path = os.fsdecode(self._paths[index])
        # UserError naming the file when it cannot be read (for encoded: when decoded)
        img = read_encoded(path) if self.encoded else load_rgb(path)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[index])


class FolderImages(ImageFiles):
    """The images of a folder or a file list, unlabeled (every label -1, no classes)."""

    def __init__(self, scan: Scan, transform=None):
        super().__init__(scan.paths, np.full(len(scan.paths), -1), [], transform, scan.files or scan.root,
                         scan.skipped, scan.unreadable)


def build(data_cfg, split: str, transform=None, lists: FileLists | None = None) -> FolderImages:
    if split != "train":
        raise UserError(f"data=folder has one split of unlabeled images (train), not {split!r}: judge its "
                        "features on a labeled set (eval.data=<name> eval.root=DIR when training, "
                        "data=<name> data.root=DIR for knn / linear)")
    return FolderImages(lists.get(data_cfg) if lists is not None else find(data_cfg), transform)


def serve_encoded(dataset) -> bool:
    """Make the file dataset under `dataset` (through subset wrappers) yield EncodedImage
    instead of PIL images. False when there are no files (in-memory datasets)."""
    seen = 0
    while not isinstance(dataset, ImageFiles) and seen < 8:
        inner = getattr(dataset, "base", None) or getattr(dataset, "dataset", None)
        if inner is None:
            return False
        dataset, seen = inner, seen + 1
    if not isinstance(dataset, ImageFiles):
        return False
    dataset.encoded = True
    return True
