"""`mount.cachefs`: the helper mount(8) runs for `mount -t cachefs` and /etc/fstab lines.

    mount -t cachefs /nfs/imagenet /mnt/imagenet -o ram_size=16GiB,cache_dir=/nvme/cachefs
    /nfs/imagenet  /mnt/imagenet  cachefs  ram_size=16GiB,cache_dir=/nvme/cachefs,_netdev,nofail  0 0

mount(8) calls `/sbin/mount.cachefs SPEC DIR [-sfnv] [-N NAMESPACE] [-o OPTIONS] [-t TYPE]`.
Every `cachefs mount` option is accepted in -o, spelled with underscores or dashes
(`ram_size=16GiB`, `allow_other`); the options mount(8) and systemd keep for themselves
(`_netdev`, `nofail`, `noauto`, `x-systemd.*`, `defaults`, `rw`, ...) are ignored, as a
helper must. Bad input is one line on stderr and exit status 1; a mount that fails, 32
(mount(8)'s codes).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Sequence

# mount(8)'s exit codes
EX_USAGE = 1
EX_FAIL = 32

# Options that belong to mount(8), libmount, systemd or the kernel's generic mount flags:
# meaningful to them, nothing for cachefs to do.
_GENERIC = {
    "defaults", "rw", "ro", "auto", "noauto", "user", "users", "nouser", "owner", "group", "_netdev", "nofail",
    "exec", "noexec", "suid", "nosuid", "dev", "nodev", "sync", "async", "atime", "noatime", "relatime",
    "norelatime", "strictatime", "nostrictatime", "lazytime", "nolazytime", "diratime", "nodiratime",
    "silent", "loud", "mand", "nomand", "iversion", "noiversion", "bg", "fg",
}
_GENERIC_PREFIXES = ("x-", "X-", "comment=", "user=", "context=", "fscontext=", "defcontext=", "rootcontext=")
# cachefs mount options that make no sense from mount(8): it must return once mounted.
_REFUSED = {"foreground", "f", "help", "h"}


def _mount_options() -> dict[str, bool]:
    """`cachefs mount`'s long options, as option name -> takes a value."""
    from cachefs.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    mount = sub.choices["mount"]
    options = {}
    for action in mount._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                options[flag[2:]] = action.nargs != 0
    return options


def split_options(text: str) -> list[str]:
    """Split a -o list on commas; a backslash escapes a comma (as libfuse does)."""
    out, cur, i = [], "", 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur += text[i + 1]
            i += 2
            continue
        if c == ",":
            out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur)
    return [o for o in out if o]


def translate(options: list[str], sloppy: bool = False) -> tuple[list[str], list[str]]:
    """cachefs mount arguments for mount(8) options, and warnings (ignored unknown options
    under -s). Raises ValueError with a one-line message on an unknown or malformed option."""
    known = _mount_options()
    args: list[str] = []
    warnings: list[str] = []
    for opt in options:
        if opt in _GENERIC or opt.startswith(_GENERIC_PREFIXES):
            continue
        name, eq, value = opt.partition("=")
        flag = name.replace("_", "-")
        if flag == "verbose" and not eq:
            args.append("-v")
            continue
        if flag in _REFUSED or flag not in known:
            problem = (f"option {name!r} cannot be used from mount: the helper returns once the mount is live"
                       if flag in _REFUSED else f"unknown option {name!r}")
            if sloppy and flag not in _REFUSED:
                warnings.append(f"ignoring {problem}")
                continue
            raise ValueError(problem)
        if known[flag]:
            if not eq or not value:
                raise ValueError(f"option {name!r} needs a value: {name}=...")
            args += [f"--{flag}", value]
        else:
            if eq:
                raise ValueError(f"option {name!r} takes no value")
            args.append(f"--{flag}")
    return args, warnings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mount.cachefs", add_help=True,
                                description="mount(8) helper: mount.cachefs SOURCE MOUNTPOINT [-o OPTIONS]")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTIONS")
    p.add_argument("-s", dest="sloppy", action="store_true", help="ignore unknown options")
    p.add_argument("-f", dest="fake", action="store_true", help="check everything, mount nothing")
    p.add_argument("-n", dest="nomtab", action="store_true", help="accepted (there is no mtab to write)")
    p.add_argument("-v", dest="verbose", action="store_true")
    p.add_argument("-N", dest="namespace", metavar="NAMESPACE")
    p.add_argument("-t", dest="type", metavar="TYPE")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    try:
        if rest:
            raise ValueError(f"unexpected arguments: {' '.join(rest)}")
        if args.type not in (None, "cachefs", "fuse.cachefs"):
            raise ValueError(f"filesystem type {args.type!r} is not cachefs")
        if args.namespace:
            raise ValueError("-N (mount in another namespace) is not supported; run mount inside that namespace")
        options = [o for text in args.options for o in split_options(text)]
        extra, warnings = translate(options, sloppy=args.sloppy)
    except ValueError as exc:
        print(f"mount.cachefs: error: {exc}", file=sys.stderr)
        return EX_USAGE
    for warning in warnings:
        print(f"mount.cachefs: {warning}", file=sys.stderr)
    command = ["mount", args.source, args.mountpoint, *extra]
    if args.verbose:
        print("mount.cachefs: cachefs " + " ".join(command), file=sys.stderr)
    from cachefs.cli import main as cachefs_main

    if args.fake:
        command.append("--check")
    try:
        # A helper says nothing on success unless asked (-v); errors still go to stderr.
        with contextlib.redirect_stdout(sys.stdout if args.verbose else io.StringIO()):
            code = cachefs_main(command)
    except SystemExit as exc:  # argparse's usage errors (a malformed size, ...)
        code = exc.code if isinstance(exc.code, int) else 2
    return {0: 0, 2: EX_USAGE}.get(code, EX_FAIL)


if __name__ == "__main__":
    sys.exit(main())
