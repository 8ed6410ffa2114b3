"""cachefs's own FUSE layer: the kernel protocol (`protocol`), mounting (`kernel`) and the
request loop (`session`). It knows nothing of caching; `cachefs.fs` is the file system.

It replaces libfuse: Debian 12 and Ubuntu 24.04 ship libfuse 3.14, which has no passthrough,
and a binding through ctypes costs about a millisecond of CPU per file.
"""

from cachefs.fuse.kernel import MountError, mount, unmount
from cachefs.fuse.ops import Connection, DirItem, Entry, FuseError, Opened, Operations, Request, StatFs
from cachefs.fuse.session import Session

__all__ = ["Connection", "DirItem", "Entry", "FuseError", "MountError", "Opened", "Operations", "Request",
           "Session", "StatFs", "mount", "unmount"]
