"""File-system mechanics of :mod:`adaptdl.checkpoint`: layout, durability, pruning.

A checkpoint root (``ADAPTDL_CHECKPOINT_PATH``) holds committed checkpoints
named ``checkpoint-<restarts>`` or ``checkpoint-<restarts>.<seq>``, one file per
state inside, plus possibly temporary directories ``.tmp-checkpoint-*`` left by
saves in progress or by saves that died. The rules that keep it crash-safe:

* a checkpoint is written in full into a fresh temporary directory; every file
  and the directory itself are fsynced before the directory is renamed to its
  final name, and the root is fsynced after the rename, so a directory that
  matches the committed-name pattern is always complete;
* the final name always sorts after every committed checkpoint already
  present, so "newest" is simply the largest ``(restarts, seq)`` key and a
  second save in the same restart generation gets ``.1``, ``.2``, ... instead of
  colliding with the first (the original failed there with ENOTEMPTY);
* older checkpoints and stale temporary directories are deleted only after the
  new checkpoint is durable; a crash while pruning leaves extra old
  directories behind, never a missing new one;
* readers only ever look at committed names, so half-written temporary
  directories can never be loaded.

Only one process (rank 0 of the current generation) writes into a root at a
time; that is how AdaptDL jobs run. Saves from several threads of that
process are safe too: their temporary directories are tracked and spared by
pruning. A second process saving into the same root by mistake (two jobs
given one path) must not make a committed checkpoint empty: pruning spares
temporary directories whose writer (its pid is in the name) is alive, and
claims a stale one by renaming it before deleting it, so a writer that
commits at that moment fails loudly instead of committing a directory that
is being emptied.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

logger = logging.getLogger(__name__)

CKPT_DIR_PREFIX = "checkpoint-"
TMP_DIR_PREFIX = ".tmp-checkpoint-"

_COMMITTED_RE = re.compile(r"^checkpoint-(\d+)(?:\.(\d+))?$")

# A commit re-lists the root and retries with a larger name when a directory
# of the chosen name appeared meanwhile; more than a few retries means the
# listing cannot see what blocks the rename, so give up instead of spinning.
_MAX_RENAME_ATTEMPTS = 16

# Temporary directories of saves still in progress in this process (several
# threads may save at once); pruning after a commit must leave them alone.
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def _writer_alive(name: str) -> bool:
    """Whether the temporary directory ``name`` belongs to another live process.

    Its name starts with the writer's pid; this process's own saves are
    tracked in ``_ACTIVE`` instead. A reused pid only keeps a stale
    directory a while longer.
    """
    pid_text = name[len(TMP_DIR_PREFIX) :].split("-", 1)[0]
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid() or not 0 < pid < 2**22:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def _new_lock_after_fork() -> None:
    global _ACTIVE_LOCK
    _ACTIVE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)

# Longest file name most file systems accept.
_MAX_FILENAME = 255


@dataclass(frozen=True, order=True)
class CheckpointKey:
    """Sort key of a committed checkpoint: restart generation, then save number."""

    restarts: int
    seq: int

    @property
    def dirname(self) -> str:
        """The directory name this key is stored under."""
        if self.seq == 0:
            return f"{CKPT_DIR_PREFIX}{self.restarts}"
        return f"{CKPT_DIR_PREFIX}{self.restarts}.{self.seq}"


def parse_dirname(name: str) -> CheckpointKey | None:
    """Return the key of a committed checkpoint directory name, else None."""
    match = _COMMITTED_RE.match(name)
    if match is None:
        return None
    return CheckpointKey(int(match.group(1)), int(match.group(2) or 0))


def list_checkpoints(root: str) -> list[tuple[CheckpointKey, str]]:
    """All committed checkpoints under ``root``, oldest first.

    A missing or unreadable root simply has no checkpoints: a job that has
    never saved must be able to start, which the original did not allow.
    """
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[tuple[CheckpointKey, str]] = []
    for entry in entries:
        key = parse_dirname(entry.name)
        if key is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        found.append((key, entry.path))
    found.sort()
    return found


def newest_checkpoint(root: str) -> tuple[CheckpointKey, str] | None:
    """The committed checkpoint with the largest key under ``root``, if any."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def state_filename(name: str) -> str:
    """The file name that holds the state called ``name`` inside a checkpoint.

    Names are percent-encoded so that any string (with ``/``, spaces or
    non-ASCII text) maps to exactly one safe file name, and a leading dot is
    encoded too so a state can never be mistaken for ``.``/``..`` or a hidden
    temporary file. The encoding is injective because ``%`` itself is encoded.

    Raises:
        ValueError: the encoded name is empty or too long for a file name.
    """
    encoded = urllib.parse.quote(name, safe="")
    if encoded.startswith("."):
        stripped = encoded.lstrip(".")
        encoded = "%2E" * (len(encoded) - len(stripped)) + stripped
    if not encoded:
        raise ValueError("state name must be a non-empty string, got ''")
    if len(encoded) > _MAX_FILENAME:
        raise ValueError(
            f"state name {name!r} is too long: it encodes to {len(encoded)} characters, "
            f"at most {_MAX_FILENAME} fit in a file name"
        )
    return encoded


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (creations, renames, deletions) to disk.

    Some platforms and network file systems cannot open or fsync a directory;
    there the rename is as durable as the file system makes it, which is the
    best that can be done, so those errors are logged and ignored.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        logger.debug("cannot open directory %s to fsync it: %s", path, error)
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
        logger.debug("file system does not fsync directory %s: %s", path, error)
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    with open(path, "rb") as fileobj:
        os.fsync(fileobj.fileno())


def remove_tree(path: str) -> None:
    """Delete a directory tree, logging (not raising) what could not be removed.

    Pruning is housekeeping after a successful commit; failing the save
    because an old directory could not be deleted would throw away a good
    checkpoint for nothing.
    """

    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        logger.warning("could not remove all of %s while pruning checkpoints", path)


def create_root(root: str) -> None:
    """Create the checkpoint root (and parents) durably if it does not exist."""
    if os.path.isdir(root):
        return
    os.makedirs(root, exist_ok=True)
    fsync_dir(os.path.dirname(os.path.abspath(root)))


class PendingCheckpoint:
    """A checkpoint being written into a temporary directory under ``root``.

    Usage: :meth:`open_state` for each state, optionally
    :meth:`carry_over` files from the previous checkpoint, then :meth:`commit`
    (or :meth:`abort` on failure). Nothing under a committed name changes until
    :meth:`commit` renames the finished directory into place.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        create_root(root)
        self.path = os.path.join(root, f"{TMP_DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        # Registered before it exists: another thread's commit prunes every
        # temporary directory it does not know, and could otherwise delete
        # this one between the mkdir and the registration.
        with _ACTIVE_LOCK:
            _ACTIVE.add(os.path.abspath(self.path))
        try:
            os.mkdir(self.path)
        except BaseException:
            self._forget()
            raise
        self._written: set[str] = set()
        self._closed = False

    @contextlib.contextmanager
    def open_state(self, name: str) -> Iterator[BinaryIO]:
        """Open the file for state ``name`` for writing; fsync it on close.

        The writer may close the file object itself (some serialisers do);
        the data is then fsynced through a fresh descriptor.
        """
        filename = state_filename(name)
        target = os.path.join(self.path, filename)
        if filename in self._written:
            raise ValueError(f"state {name!r} was already written into this checkpoint")
        self._written.add(filename)
        fileobj = open(target, "xb")
        try:
            yield fileobj
            if not fileobj.closed:
                fileobj.flush()
                os.fsync(fileobj.fileno())
        finally:
            closed_by_writer = fileobj.closed
            fileobj.close()
        if closed_by_writer:
            _fsync_path(target)

    def carry_over(self, source: str, skip: Callable[[str], bool] | None = None) -> list[str]:
        """Copy into this checkpoint every state file of ``source`` not written yet.

        Files are hard-linked when possible (they are never modified after a
        commit, so sharing the inode is safe and costs no I/O) and copied and
        fsynced otherwise; those whose name ``skip`` holds for are left out.
        Returns the carried file names.
        """
        carried: list[str] = []
        try:
            entries = list(os.scandir(source))
        except FileNotFoundError:
            return carried
        for entry in entries:
            if entry.name in self._written or not entry.is_file(follow_symlinks=False):
                continue
            if skip is not None and skip(entry.name):
                continue
            target = os.path.join(self.path, entry.name)
            try:
                os.link(entry.path, target)
            except FileNotFoundError:
                continue  # pruned under our feet; nothing left to carry
            except OSError:
                shutil.copyfile(entry.path, target)
                _fsync_path(target)
            self._written.add(entry.name)
            carried.append(entry.name)
        return carried

    def commit(self, num_restarts: int) -> str:
        """Make the checkpoint durable and visible, then prune older ones.

        Args:
            num_restarts: the current restart generation, used in the name
                unless the root already holds a checkpoint at least that new.

        Returns:
            The path of the committed checkpoint directory.
        """
        if self._closed:
            raise RuntimeError(f"checkpoint {self.path} was already committed or aborted")
        fsync_dir(self.path)
        for _ in range(_MAX_RENAME_ATTEMPTS):
            newest = newest_checkpoint(self.root)
            if newest is None or newest[0].restarts < num_restarts:
                key = CheckpointKey(num_restarts, 0)
            else:
                if newest[0].restarts > num_restarts:
                    logger.warning(
                        "%s already holds %s, from a later restart than the current "
                        "ADAPTDL_NUM_RESTARTS=%d; naming the new checkpoint after it so "
                        "that it is still the one loaded next",
                        self.root,
                        newest[0].dirname,
                        num_restarts,
                    )
                key = CheckpointKey(newest[0].restarts, newest[0].seq + 1)
            final = os.path.join(self.root, key.dirname)
            while os.path.lexists(final) and (os.path.islink(final) or not os.path.isdir(final)):
                # Not a checkpoint (listings skip it), but it holds the name.
                logger.warning(
                    "%s is not a checkpoint directory but holds a checkpoint's name; "
                    "skipping that name (remove the file to silence this)",
                    final,
                )
                key = CheckpointKey(key.restarts, key.seq + 1)
                final = os.path.join(self.root, key.dirname)
            try:
                os.rename(self.path, final)
            except OSError as error:
                # A directory of that name appeared between listing and
                # renaming (or a non-directory squats on it): pick the next.
                if error.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR) and (
                    os.path.lexists(final)
                ):
                    if not os.path.isdir(final):
                        raise
                    continue
                raise
            break
        else:
            raise RuntimeError(
                f"could not find a free checkpoint name in {self.root} after "
                f"{_MAX_RENAME_ATTEMPTS} attempts; is another process saving there?"
            )
        self._closed = True
        self._forget()
        fsync_dir(self.root)
        self._prune(key)
        return final

    def _prune(self, keep: CheckpointKey) -> None:
        """Delete checkpoints older than ``keep`` and every temporary directory."""
        removed = False
        for key, path in list_checkpoints(self.root):
            if key < keep:
                remove_tree(path)
                removed = True
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if not entry.name.startswith(TMP_DIR_PREFIX):
                    continue
                with _ACTIVE_LOCK:
                    in_progress = os.path.abspath(entry.path) in _ACTIVE
                if in_progress or _writer_alive(entry.name):
                    continue
                if not entry.is_dir(follow_symlinks=False):
                    continue
                claimed = os.path.join(self.root, f"{TMP_DIR_PREFIX}stale-{uuid.uuid4().hex}")
                try:
                    os.rename(entry.path, claimed)
                except OSError:
                    continue  # committed or removed by someone else meanwhile
                logger.info("removing stale temporary checkpoint %s", entry.path)
                remove_tree(claimed)
                removed = True
        if removed:
            fsync_dir(self.root)

    def abort(self) -> None:
        """Throw the unfinished checkpoint away (best effort)."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        self._forget()

    def _forget(self) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(os.path.abspath(self.path))
