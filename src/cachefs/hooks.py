"""What the FUSE layer tells the core once the kernel has answered INIT, and what the core
tells the file system.

The core is built before the mount exists; three things are only known after it: how to
hand a request's thread back while it waits on the source (the session's `blocking`),
how to make the kernel forget a name whose file changed (`on_source_changed`), and
whether opens are passed through (`passthrough`). The daemon builds one KernelHooks, gives
it to the core and to the file system, and the file system calls `connect` at INIT. Until
then (and with no mount at all: the unit tests, tools) the defaults hold. The file system
also hears here of a cached file found unchanged on the source (`on_confirmed`: its
table node renewed for the serving processes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager


class KernelHooks:
    def __init__(self) -> None:
        # Around anything that may wait on the source: another thread takes requests
        # meanwhile (cachefs.fuse.session.Session.blocking).
        self.blocking: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        # Files fetched whole go to the NVMe tier only, where there is one (BlockPath.open_file)
        self.passthrough = False
        # Called with a path whose cached identity turned out wrong, instead of the core's
        # own invalidate (None): the file system forgets it and has the kernel look it up again.
        self.on_source_changed: Callable[[str], None] | None = None
        # Called with the entry id of a cached file version the source was found to have
        # still (its attributes good as of now), and its record of the entry table (-1: unknown)
        self.on_confirmed: Callable[[bytes, int], None] | None = None

    def connect(self, blocking: Callable[[], AbstractContextManager[None]] | None = None,
                on_source_changed: Callable[[str], None] | None = None, passthrough: bool | None = None,
                on_confirmed: Callable[[bytes, int], None] | None = None) -> None:
        if blocking is not None:
            self.blocking = blocking
        if on_source_changed is not None:
            self.on_source_changed = on_source_changed
        if on_confirmed is not None:
            self.on_confirmed = on_confirmed
        if passthrough is not None:
            self.passthrough = passthrough
