"""Output paths, checked before any work and written without losing what was there: the light half of
``analysis.core.io`` (no torch, numpy or pandas), so that the command line can refuse a bad ``--json`` / ``--out``
in well under a second."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output(path, *, flag: str, folder: bool = False) -> Path:
    """Check that an output path can be written, before any work: the command line calls it before the model loads.

    A file must not exist as a folder (a folder: not as a file); the nearest part of its path that exists must be a
    writable folder (missing folders below it are created when the results are written).

    Parameters
    ----------
    path : path-like
        The file (``--json``, ``--csv``) or folder (``--out``) to write.
    flag : str
        The option that named it, for the message.
    folder : bool
        The path is a folder.

    Returns
    -------
    pathlib.Path
        The path; ValueError, one line naming the flag and what to do, otherwise.
    """
    p = Path(path).expanduser()
    what = "folder" if folder else "file"
    if p.exists() and p.is_dir() != folder:
        raise ValueError(
            f"{flag} {path}: it exists and is a {'file, not a folder' if folder else 'folder, not a file'}; give the path of a "
            f"{what} to write{' (e.g. ' + str(p / ('results.csv' if 'csv' in flag else 'results.json')) + ')' if not folder else ''}."
        )
    parent = p if (folder and p.exists()) else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(
            f"{flag} {path}: {parent} is a file, not a folder, so nothing can be written under it; "
            f"give a {what} path under a folder."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"{flag} {path}: the folder {parent} is not writable; give a {what} path in a folder you can write to."
        )
    return p


class OutputError(OSError):
    """An output could not be written; the message says what was kept and where the results are instead."""


def write_or_spare(path, write, *, flag: str = "") -> Path:
    """``write(path)``; where that fails, ``write`` into a fresh temporary folder instead, and say where.

    ``write`` must write atomically (``write_json``, ``write_atomic``, ``replace_dir``), so that a failed write leaves
    what ``path`` held before.

    Parameters
    ----------
    path : path-like
        The file or folder to write.
    write : callable
        ``write(target_path)``.
    flag : str
        The option that named ``path``, for the message.

    Returns
    -------
    pathlib.Path
        ``path``; OutputError (exit 1 on the command line) where it could not be written, naming the spare copy.
    """
    path = Path(path).expanduser()
    try:
        write(path)
        return path
    except OSError as e:
        spare = Path(tempfile.mkdtemp(prefix="analysis-results-")) / path.name
        try:
            write(spare)
            where = f"the results were written to {spare} instead"
        except OSError:
            where = "the results are only in what was printed above"
        raise OutputError(
            f"could not write {(flag + ' ') if flag else ''}{path} ({type(e).__name__}: {e}); what it "
            f"held before is unchanged, and {where}."
        ) from None
