"""cachefs as users install and run it: next to libfuse 2, through mount(8) and /etc/fstab,
as a systemd unit, as an unprivileged user, and from a directory that holds a clone."""

from __future__ import annotations

import configparser
import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import NOBODY, ROOT, as_user, cli, is_mounted, portable_python, stats

UNIT = Path(ROOT) / "contrib" / "systemd" / "cachefs@.service"
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root (installs into /sbin, edits /etc/fuse.conf)")


def _libfuse2_present() -> bool:
    try:
        ctypes.CDLL("libfuse.so.2")
        return True
    except OSError:
        return False


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.bin").write_bytes(os.urandom(300_000))
    (src / "hello").write_text("hello\n")
    mp = tmp_path / "mnt"
    mp.mkdir()
    return src, mp


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- libfuse 3, whatever else is installed -------------------------------------------------

@pytest.mark.skipif(not _libfuse2_present(), reason="libfuse 2 is not installed here (CI installs it on purpose)")
def test_mounts_with_libfuse2_installed_next_to_libfuse3(tree, tmp_path):
    """A binding that looked for libfuse 2 first broke every mount on such machines. cachefs
    speaks the kernel protocol itself: no libfuse is loaded at all, whichever is installed."""
    assert ctypes.util.find_library("fuse") == "libfuse.so.2"  # the trap is really there
    src, mp = tree
    env = dict(os.environ, FUSE_LIBRARY_PATH="libfuse.so.2")  # what made the old binding fail
    proc = subprocess.run([sys.executable, "-m", "cachefs", "mount", src, mp, "--cache-dir", tmp_path / "cache",
                           "--ram-size", "64MiB", "--disk-size", "64MiB"], capture_output=True, text=True, env=env)
    try:
        assert proc.returncode == 0, proc.stderr
        assert (mp / "d" / "f.bin").read_bytes() == (src / "d" / "f.bin").read_bytes()
        pid = stats(mp)["info"]["pid"]
        with open(f"/proc/{pid}/maps") as f:
            assert not re.search(r"libfuse3?\.so", f.read())
    finally:
        cli("umount", mp)


# -- mount(8), /etc/fstab ----------------------------------------------------------------------

@contextlib.contextmanager
def _linked(ours: str, target: str):
    """`target` linking to this checkout's `ours`, as an admin installs it; removed after if
    the test made it. Skips when another installation already owns `target`."""
    if os.path.lexists(target):
        if os.path.realpath(target) != os.path.realpath(ours):
            pytest.skip(f"another {target} is installed ({os.path.realpath(target)})")
        yield target
        return
    os.symlink(ours, target)
    try:
        yield target
    finally:
        os.unlink(target)


@pytest.fixture
def mount_helper():
    """/sbin/mount.cachefs, where mount(8) looks for it."""
    with _linked(os.path.join(os.path.dirname(sys.executable), "mount.cachefs"), "/sbin/mount.cachefs") as link:
        yield link


def _umount(mp):
    subprocess.run(["umount", str(mp)], capture_output=True)
    _wait(lambda: not is_mounted(mp), 10)


@root_only
def test_mount_t_cachefs_with_options(tree, tmp_path, mount_helper):
    src, mp = tree
    cache = tmp_path / "cache"
    proc = subprocess.run(["mount", "-t", "cachefs", str(src), str(mp), "-o",
                           f"ram_size=64MiB,disk_size=64MiB,cache_dir={cache},metadata_ttl=7,_netdev,nofail"],
                          capture_output=True, text=True, timeout=60)
    try:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ""  # a helper is quiet unless asked (-v)
        assert (mp / "hello").read_text() == "hello\n"
        info = stats(mp)["info"]
        assert info["metadata_ttl"] == 7 and info["cache_dir"] == str(cache)
        assert stats(mp)["ram"]["capacity_bytes"] == 64 << 20
    finally:
        _umount(mp)
    assert not is_mounted(mp)
    bad = subprocess.run(["mount", "-t", "cachefs", str(src), str(mp), "-o", "ram_sise=1G"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unknown option 'ram_sise'" in bad.stderr and not is_mounted(mp)


@root_only
def test_an_fstab_line_mounts_with_mount_a(tree, tmp_path, mount_helper):
    src, mp = tree
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# cachefs in front of a slow store\n"
                     f"{src}  {mp}  cachefs  ram_size=32MiB,disk_size=64MiB,cache_dir={tmp_path / 'cache'},"
                     f"_netdev,nofail,x-systemd.requires={src}  0 0\n")
    try:
        first = subprocess.run(["mount", "-a", "-T", str(fstab)], capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        assert is_mounted(mp) and (mp / "d" / "f.bin").read_bytes() == (src / "d" / "f.bin").read_bytes()
        again = subprocess.run(["mount", "-a", "-T", str(fstab), "-v"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already mounted" in again.stdout  # mount(8) recognises it
        assert stats(mp)["ram"]["capacity_bytes"] == 32 << 20
    finally:
        _umount(mp)
    assert not is_mounted(mp)


# -- systemd -------------------------------------------------------------------------------------

@pytest.fixture
def cachefs_in_usr_local():
    """/usr/local/bin/cachefs, where the unit expects it."""
    with _linked(os.path.join(os.path.dirname(sys.executable), "cachefs"), "/usr/local/bin/cachefs") as link:
        yield link


@root_only
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_the_unit_file_verifies(tmp_path, cachefs_in_usr_local):
    unit = tmp_path / "cachefs@mnt-data.service"
    shutil.copy(UNIT, unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    complaints = [line for line in proc.stderr.splitlines() if "cachefs" in line]
    assert proc.returncode == 0 and not complaints, proc.stderr


def _escape_path(path: str) -> str:
    """`systemd-escape --path PATH`: "/" becomes "-", other bytes outside [A-Za-z0-9:_.] \\xNN."""
    out = []
    for i, ch in enumerate(path.strip("/")):
        if ch == "/":
            out.append("-")
        elif ch.isascii() and (ch.isalnum() or ch in ":_" or (ch == "." and i > 0)):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out)


def _unescape_path(instance: str) -> str:
    """systemd's %f: the instance name unescaped, as an absolute path."""
    raw = instance.replace("-", "/")
    return "/" + re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), raw)


def _systemd_words(line: str, env: dict[str, str], instance: str) -> list[str]:
    """An Exec line as systemd expands it: %i and %f, ${VAR} as one word, $VAR split."""
    line = line.replace("%i", instance).replace("%f", _unescape_path(instance))
    words = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$\{(\w+)\}", word)
        split = re.fullmatch(r"\$(\w+)", word)
        if whole:
            words.append(env.get(whole.group(1), ""))
        elif split:
            words += env.get(split.group(1), "").split()
        else:
            words.append(word)
    return words


@root_only
def test_the_unit_mounts_notifies_ready_and_unmounts_on_stop(tree, tmp_path, cachefs_in_usr_local):
    """The unit's own Exec lines, run as systemd runs a Type=notify service: READY=1 once the
    mount is live, and SIGTERM (the stop) unmounts after writing the cache, exit 0."""
    src, _ = tree
    mp = Path(tempfile.mkdtemp(prefix="cachefs-unit-", dir="/tmp"))
    os.rmdir(mp)  # ExecStartPre creates it
    instance = _escape_path(str(mp))
    if shutil.which("systemd-escape"):
        assert instance == subprocess.run(["systemd-escape", "--path", str(mp)], capture_output=True,
                                          text=True).stdout.strip()
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(UNIT)
    service = unit["Service"]
    assert service["Type"] == "notify" and service["EnvironmentFile"] == "/etc/cachefs/%i.conf"
    env = {"CACHEFS_SOURCE": str(src),
           "CACHEFS_OPTIONS": f"--ram-size 64MiB --disk-size 64MiB --cache-dir {tmp_path / 'cache'}"}
    notify = tmp_path / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    listener.settimeout(30)
    assert _unescape_path(instance) == str(mp)
    subprocess.run(_systemd_words(service["ExecStartPre"], env, instance), check=True)
    proc = subprocess.Popen(_systemd_words(service["ExecStart"], env, instance), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, NOTIFY_SOCKET=str(notify)))
    try:
        message = listener.recv(4096).decode()
        assert "READY=1" in message.splitlines()
        assert is_mounted(mp) and (mp / "hello").read_text() == "hello\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert not is_mounted(mp) and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)
        listener.close()
        shutil.rmtree(mp, ignore_errors=True)


# -- an unprivileged user --------------------------------------------------------------------

@pytest.fixture
def dev_fuse_for_all():
    """/dev/fuse open to every user (0666), as distributions ship it; some containers make it
    0600. Restored afterwards."""
    mode = os.stat("/dev/fuse").st_mode & 0o777
    os.chmod("/dev/fuse", 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


@pytest.fixture
def nobody_env(dev_fuse_for_all):
    """A world-readable work dir, and the interpreter and environment to run cachefs as nobody."""
    base = Path(tempfile.mkdtemp(prefix="cachefs-user-"))
    os.chmod(base, 0o755)
    try:
        python, env = portable_python(base)
    except RuntimeError as exc:
        shutil.rmtree(base)
        pytest.skip(f"no interpreter another user can run cachefs with: {exc}")
    try:
        yield base, python, env
    finally:
        for mp in base.glob("mnt*"):
            subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _user_tree(base: Path) -> tuple[Path, Path, Path]:
    """A source the user may read, a mount point and a home for the cache it owns."""
    src, mp, home = base / "src", base / "mnt", base / "home"
    src.mkdir(mode=0o755)
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    cache = home / "cache"
    (src / "data.bin").write_bytes(os.urandom(200_000))
    os.chmod(src / "data.bin", 0o644)
    mp.mkdir()
    os.chown(mp, NOBODY, NOBODY)
    return src, mp, cache


@root_only
def test_an_unprivileged_user_mounts_through_fusermount3(nobody_env):
    base, python, env = nobody_env
    src, mp, cache = _user_tree(base)
    run = lambda *args: as_user([python, "-m", "cachefs", *map(str, args)], env=env)
    proc = run("mount", src, mp, "--cache-dir", cache, "--ram-size", "32MiB", "--disk-size", "32MiB")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        digest = as_user([python, "-c", f"import hashlib; print(hashlib.sha256(open({str(mp / 'data.bin')!r}, "
                                        "'rb').read()).hexdigest())"], env=env)
        assert digest.returncode == 0, digest.stderr
        assert digest.stdout.strip() == hashlib.sha256((src / "data.bin").read_bytes()).hexdigest()
        st = run("stats", mp, "--json")
        assert st.returncode == 0 and '"schema"' in st.stdout
        assert os.stat(cache).st_uid == NOBODY and (os.stat(cache).st_mode & 0o777) == 0o700
        # no --allow-other: not even root gets in
        with pytest.raises(PermissionError):
            os.listdir(mp)
    finally:
        done = run("umount", mp)
    assert done.returncode == 0, done.stderr
    assert not is_mounted(mp)


@root_only
def test_allow_other_needs_user_allow_other(nobody_env):
    base, python, env = nobody_env
    src, mp, cache = _user_tree(base)
    args = [python, "-m", "cachefs", "mount", str(src), str(mp), "--cache-dir", str(cache), "--ram-size", "32MiB",
            "--disk-size", "32MiB", "--allow-other"]
    conf = Path("/etc/fuse.conf")
    saved = conf.read_text() if conf.exists() else None
    try:
        conf.write_text("# written by cachefs's tests\n")
        refused = as_user(args, env=env)
        assert refused.returncode == 2 and "user_allow_other" in refused.stderr
        conf.write_text("user_allow_other\n")
        allowed = as_user(args, env=env)
        assert allowed.returncode == 0, allowed.stderr
        assert (mp / "data.bin").read_bytes() == (src / "data.bin").read_bytes()  # root, another user
        assert as_user([python, "-m", "cachefs", "umount", str(mp)], env=env).returncode == 0
    finally:
        if saved is None:
            conf.unlink(missing_ok=True)
        else:
            conf.write_text(saved)
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)


@root_only
def test_a_failed_mount_says_why_in_one_line(nobody_env):
    """fusermount3 refuses a mount point the user may not write; the error carries its own
    reason, not "see the log"."""
    base, python, env = nobody_env
    src, mp, cache = _user_tree(base)
    os.chown(mp, 0, 0)
    os.chmod(mp, 0o755)
    proc = as_user([python, "-m", "cachefs", "mount", str(src), str(mp), "--cache-dir", str(cache)], env=env)
    assert proc.returncode == 1 and not is_mounted(mp)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "fusermount3: user has no write access to mountpoint" in lines[0], lines[0]


@root_only
def test_a_closed_dev_fuse_is_one_clear_error(nobody_env):
    base, python, env = nobody_env
    src, mp, cache = _user_tree(base)
    os.chmod("/dev/fuse", 0o600)  # the fixture restores it
    proc = as_user([python, "-m", "cachefs", "mount", str(src), str(mp), "--cache-dir", str(cache)], env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "/dev/fuse is not open to this user" in proc.stderr


# -- python -m cachefs next to a clone --------------------------------------------------------

def test_python_m_cachefs_works_beside_a_clone_named_cachefs(tmp_path):
    """A clone of the project in the current directory, named like the package, must not
    shadow the installed package."""
    clone = tmp_path / "cachefs"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__",
                                                                ".*_cache", "tools"))
    proc = subprocess.run([sys.executable, "-m", "cachefs", "--version"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import cachefs

    assert proc.stdout.strip() == f"cachefs {cachefs.__version__}"


def test_a_failing_demo_keeps_its_work_dir_and_shows_the_log(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--workdir", str(work),
                           "--classes", "1", "--per-class", "2", "--latency", "soon"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "the last lines of the slowfs log" in proc.stderr and "invalid --latency 'soon'" in proc.stderr
    assert f"kept the work dir for a look: {work}" in proc.stderr and (work / "dataset").is_dir()


@pytest.mark.skipif(not shutil.which("systemd-analyze") or not shutil.which("memcached"),
                    reason="needs systemd-analyze and memcached")
def test_the_shared_cache_server_unit_verifies_and_its_command_runs(tmp_path):
    import re

    from tools.memcached import MemcachedServers

    unit = tmp_path / "cachefs-memcached.service"
    shutil.copy(os.path.join(os.path.dirname(UNIT), "cachefs-memcached.service"), unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and "cachefs-memcached" not in proc.stderr, proc.stderr
    # the unit's options, as docs/admin.md gives them, start a real server (on loopback here)
    text = unit.read_text().replace("\\\n", " ")
    line = re.search(r"ExecStart=(.*)", text).group(1).split()
    assert line[0] == "/usr/bin/memcached" and "-I" in line and line[line.index("-I") + 1] == "2m"
    opts = line[line.index("-o") + 1].replace("/nvme/memcached/extstore:400G", f"{tmp_path}/ext:64m")
    with MemcachedServers(1, str(tmp_path)) as servers:
        port = servers.ports[0]
    cmd = ["memcached", "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-m", "64", "-I", "2m", "-o", opts]
    if os.geteuid() == 0:
        cmd[1:1] = ["-u", "root"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    try:
        import time

        time.sleep(0.5)
        assert server.poll() is None, server.stderr.read()
    finally:
        server.kill()
        server.wait()
