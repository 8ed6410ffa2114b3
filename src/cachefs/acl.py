"""POSIX ACLs under --allow-other: mode bits that never grant what the source's ACL denies.

With `--allow-other` the kernel checks other users' access itself (default_permissions),
from the mode bits only. A file whose ACL names users or groups (`setfacl -m u:bob:---`)
would then be open to whoever the plain bits let in. So for a file with such an ACL, the
mode cachefs reports takes for each class of the mode the least that any user falling in
that class gets from the ACL:

- owner: the owner's entry (named entries never apply to the owner);
- group: the owning group's entry, and the entry of each named user who is a member of
  the owning group (such a user gets their own entry), under the mask;
- other: the other entry, and every named user's and group's entry, under the mask.

No user is granted more through the mount than on the source. A named entry that grants
more than the plain bits (`u:bob:r` on a 0600 file) is not honoured through the mount: bob
is refused, as he would be without the ACL. The xattr itself is passed through unchanged
(getfacl shows it).
"""

from __future__ import annotations

import errno
import functools
import grp
import pwd
import stat
import struct
from collections.abc import Callable

from cachefs.identity import Attr

XATTR = "system.posix_acl_access"

_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ENTRY = struct.Struct("<HHI")
_VERSION = 2


@functools.lru_cache(maxsize=4096)
def in_group(uid: int, gid: int) -> bool:
    """Whether user `uid` is a member of group `gid` (primary or supplementary), as the
    system's user database says; True when it cannot say (never more than the source)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return True
    if user.pw_gid == gid:
        return True
    try:
        return user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return True


def restrict(mode: int, raw: bytes, gid: int = -1,
             member: Callable[[int, int], bool] = in_group) -> int:
    """`mode` with its permission bits cut down to what the ACL `raw` (the xattr's value,
    as the kernel stores it) grants every user of each class; `gid` is the file's group.
    Unknown formats: no access for group and other (never more than the source)."""
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != _VERSION or (len(raw) - 4) % _ENTRY.size:
        return mode & ~0o077
    perms: dict[int, int] = {}
    named: list[tuple[int, int, int]] = []
    for off in range(4, len(raw), _ENTRY.size):
        tag, perm, qualifier = _ENTRY.unpack_from(raw, off)
        perm &= 7
        if tag in (_USER, _GROUP):
            named.append((tag, perm, qualifier))
        else:
            perms[tag] = perm
    if not named:
        return mode  # the plain bits say it all
    mask = perms.get(_MASK, 7)
    owner = perms.get(_USER_OBJ, (mode >> 6) & 7)
    group = perms.get(_GROUP_OBJ, (mode >> 3) & 7) & mask
    other = perms.get(_OTHER, mode & 7)
    for tag, perm, qualifier in named:
        if tag == _USER and (gid < 0 or member(qualifier, gid)):
            group &= perm & mask
        other &= perm & mask
    return (mode & ~0o777) | (owner << 6) | (group << 3) | other


def restricted(attr: Attr, path: str, getxattr: Callable[[str, str], bytes]) -> Attr:
    """`attr` with its mode cut down to what `path`'s ACL (read with `getxattr`) grants each
    class of users (restrict), so that the kernel never grants more."""
    if stat.S_ISLNK(attr.mode):
        return attr
    try:
        raw = getxattr(path, XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return attr  # no ACL (or no extended attributes here, so none)
        return attr._replace(mode=attr.mode & ~0o077)  # unknown: never more than the owner's
    return attr._replace(mode=restrict(attr.mode, raw, attr.gid))
