"""POSIX ACLs under --allow-other, and extended attributes kept with the metadata."""

import errno
import struct

import pytest

from cachefs import acl
from cachefs.memsource import MemorySource
from tests.helpers import make_core

USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20


def raw_acl(*entries):
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in entries)


def base(mode, *named, mask=None):
    entries = [(USER_OBJ, (mode >> 6) & 7, 0xFFFFFFFF), *named, (GROUP_OBJ, (mode >> 3) & 7, 0xFFFFFFFF)]
    if mask is not None:
        entries.append((MASK, mask, 0xFFFFFFFF))
    entries.append((OTHER, mode & 7, 0xFFFFFFFF))
    return raw_acl(*entries)


@pytest.mark.parametrize(("mode", "named", "mask", "want"), [
    (0o100644, [(USER, 0, 65534)], 4, 0o100640),     # u:nobody:--- on 644: others lose read
    (0o100600, [(USER, 4, 65534)], 4, 0o100600),     # u:nobody:r on 600: not granted through the mount
    (0o100664, [(GROUP, 4, 100)], 6, 0o100664 & ~0o002),  # g:users:r: others get no more than r
    (0o100666, [(USER, 6, 5)], 4, 0o100644),          # the mask caps the named user and the group
    (0o104755, [(USER, 5, 7), (GROUP, 1, 8)], 7, 0o104751),  # setuid kept; other <= every named entry
    (0o040755, [(USER, 0, 65534)], 7, 0o040750),      # a directory nobody may not enter
])
def test_the_mode_never_grants_more_than_the_acl(mode, named, mask, want):
    not_members = acl.restrict(mode, base(mode, *named, mask=mask), 100, lambda uid, gid: False)
    assert not_members == want
    # a named user who is a member of the file's group: the group class gets no more either
    members = acl.restrict(mode, base(mode, *named, mask=mask), 100, lambda uid, gid: True)
    group = (mode >> 3) & 7 & mask
    for tag, perm, _ in named:
        if tag == USER:
            group &= perm & mask
    assert (members >> 3) & 7 == group
    assert members & 0o7707 == want & 0o7707


def test_an_acl_without_named_entries_or_an_unknown_format():
    assert acl.restrict(0o100644, base(0o100644)) == 0o100644
    assert acl.restrict(0o100644, b"\x07\x00\x00\x00junk") == 0o100600


def test_modes_are_cut_down_only_under_allow_other():
    src = MemorySource()
    src.add_file("/secret", b"x", mode=0o644)
    src.set_xattr("/secret", acl.XATTR, base(0o644, (USER, 0, 65534), mask=4))
    src.add_file("/plain", b"y", mode=0o644)
    core = make_core(src)
    assert core.getattr("/secret").mode & 0o777 == 0o644  # the owner's own mount: the kernel is not asked
    core = make_core(src, check_acls=True)
    assert core.getattr("/secret").mode & 0o777 == 0o640
    assert core.getattr("/plain").mode & 0o777 == 0o644
    assert core.getxattr("/secret", acl.XATTR) == src.xattrs["/secret"][acl.XATTR]  # passed through


def test_xattrs_are_kept_with_the_metadata():
    src = MemorySource()
    for i in range(100):
        src.add_file(f"/f{i}", b"z")
    src.set_xattr("/f7", "user.tag", b"seven")
    core = make_core(src)
    for _ in range(3):  # three `ls -l`: two attributes asked of every file each time
        for i in range(100):
            for name in ("security.selinux", "system.posix_acl_access"):
                with pytest.raises(OSError) as info:
                    core.getxattr(f"/f{i}", name)
                assert info.value.errno == errno.ENODATA
    assert src.calls["listxattr"] == 100 and src.calls["getxattr"] == 0
    assert core.getxattr("/f7", "user.tag") == b"seven"
    assert core.getxattr("/f7", "user.tag") == b"seven"
    assert src.calls["getxattr"] == 1
    assert core.listxattr("/f7") == ["user.tag"] and core.listxattr("/f8") == []
