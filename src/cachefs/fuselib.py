"""Load the FUSE binding on libfuse 3, whatever else the machine has installed.

mfusepy looks for libfuse 2 first (`find_library("fuse")`) and only then for libfuse 3.
Many machines carry both (AppImages, rclone, sshfs and desktop packages pull in libfuse2),
and cachefs then mounted with libfuse 2, which rejects its libfuse 3 options: every mount
died with "fuse: unknown option `max_threads=32'". So the library is chosen here, before
the binding is imported, and its major version is checked after.

Also here: `StderrTail`, which keeps the last lines libfuse writes to stderr, so that a
failed mount is reported with libfuse's own reason instead of "see the log".
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import deque
from types import ModuleType
from typing import Any

from cachefs.errors import CachefsError

# The soname of libfuse 3 on every Linux distribution (package fuse3 / libfuse3-3 /
# fuse3-libs). dlopen() finds it through the loader's cache and paths, with no ldconfig
# subprocess.
LIBFUSE3 = "libfuse3.so.3"

INSTALL_HINT = ("install libfuse 3: apt-get install fuse3 (Debian, Ubuntu), dnf install fuse3 (Fedora, RHEL), "
                "pacman -S fuse3 (Arch), apk add fuse3 (Alpine)")


def _library_path() -> str:
    """The libfuse 3 to load: FUSE_LIBRARY_PATH if the user set one, else the system's."""
    chosen = os.environ.get("FUSE_LIBRARY_PATH")
    if chosen:
        return chosen
    try:
        ctypes.CDLL(LIBFUSE3)
    except OSError:
        raise CachefsError(f"libfuse 3 ({LIBFUSE3}) is not installed: {INSTALL_HINT}") from None
    return LIBFUSE3


def load() -> ModuleType:
    """Import mfusepy bound to libfuse 3; CachefsError (one line) if that cannot be had."""
    binding: Any = sys.modules.get("mfusepy")
    if binding is None:
        path = _library_path()
        saved = os.environ.get("FUSE_LIBRARY_PATH")
        os.environ["FUSE_LIBRARY_PATH"] = path
        try:
            import mfusepy

            binding = mfusepy
        except OSError as exc:  # the library would not load (mfusepy raises OSError too)
            raise CachefsError(f"cannot load libfuse from {path}: {exc}; {INSTALL_HINT}") from None
        finally:  # children (slowfs, tests) see the environment as it was
            if saved is None:
                os.environ.pop("FUSE_LIBRARY_PATH", None)
            else:
                os.environ["FUSE_LIBRARY_PATH"] = saved
    major, minor = binding.fuse_version_major, binding.fuse_version_minor
    if major != 3:
        raise CachefsError(f"the FUSE binding loaded libfuse {major}.{minor} ({binding._libfuse_path}); "
                           f"cachefs needs libfuse 3: unset FUSE_LIBRARY_PATH, or {INSTALL_HINT}")
    return binding


def check() -> None:
    """Fail early (before forking the daemon) when libfuse 3 cannot be loaded."""
    load()


class StderrTail:
    """While active, everything written to file descriptor 2 (libfuse's and fusermount3's
    messages) still reaches the original stderr, and the last `keep` lines are kept for an
    error message. A pipe and one thread; stopped (and stderr restored) by `stop()`."""

    def __init__(self, keep: int = 20):
        self.lines: deque[str] = deque(maxlen=keep)
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> StderrTail:
        sys.stderr.flush()
        self._saved = os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
        self._thread = threading.Thread(target=self._pump, args=(r, self._saved), name="cachefs-stderr",
                                        daemon=True)
        self._thread.start()
        return self

    def _pump(self, r: int, out: int) -> None:
        partial = b""
        with os.fdopen(r, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                try:
                    os.write(out, chunk)
                except OSError:
                    pass
                partial += chunk
                *done, partial = partial.split(b"\n")
                self.lines.extend(x.decode(errors="replace").strip() for x in done if x.strip())
        if partial.strip():
            self.lines.append(partial.decode(errors="replace").strip())

    def stop(self) -> None:
        """Restore stderr and wait until everything written so far has been read."""
        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes the pipe's last write end: the pump sees EOF
        os.close(self._saved)
        self._saved = None
        if self._thread is not None:
            self._thread.join(timeout=5)

    def last(self) -> str:
        """The last line that looks like a reason (libfuse prefixes its own with 'fuse:')."""
        for line in reversed(self.lines):
            if line.startswith(("fuse:", "fusermount")):
                return line
        return self.lines[-1] if self.lines else ""
