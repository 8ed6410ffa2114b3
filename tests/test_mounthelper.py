"""mount.cachefs: mount(8) options to `cachefs mount` arguments, without mounting."""

import pytest

from cachefs.mounthelper import EX_USAGE, main, split_options, translate


def test_cachefs_options_map_to_the_cli_with_underscores_or_dashes():
    args, warnings = translate(["ram_size=8GiB", "cache-dir=/nvme/c", "allow_other", "metadata_ttl=1",
                                "readahead=file", "verbose"])
    assert args == ["--ram-size", "8GiB", "--cache-dir", "/nvme/c", "--allow-other", "--metadata-ttl", "1",
                    "--readahead", "file", "-v"]
    assert warnings == []


def test_options_of_mount_and_systemd_are_ignored():
    generic = ["defaults", "rw", "ro", "_netdev", "nofail", "noauto", "auto", "user", "nosuid", "nodev",
               "noatime", "x-systemd.requires=/nfs", "x-systemd.automount", "X-mount.mkdir",
               "comment=systemd.automount", "user=alice"]
    assert translate(generic) == ([], [])


@pytest.mark.parametrize("option, message", [
    ("bogus=1", "unknown option 'bogus'"),
    ("ram_size", "needs a value"),
    ("ram_size=", "needs a value"),
    ("allow_other=yes", "takes no value"),
    ("foreground", "cannot be used from mount"),
])
def test_bad_options_are_one_line_errors(option, message):
    with pytest.raises(ValueError, match=message):
        translate([option])


def test_sloppy_mode_warns_and_goes_on():
    args, warnings = translate(["bogus=1", "ram_size=1GiB"], sloppy=True)
    assert args == ["--ram-size", "1GiB"] and warnings == ["ignoring unknown option 'bogus'"]
    with pytest.raises(ValueError):  # a helper that returned before mounting would be worse
        translate(["foreground"], sloppy=True)


def test_a_backslash_escapes_a_comma():
    assert split_options(r"cache_dir=/a\,b,ram_size=1G,,") == ["cache_dir=/a,b", "ram_size=1G"]


def test_the_helper_exits_as_mount_expects(tmp_path, capsys):
    assert main([str(tmp_path), str(tmp_path / "m"), "-o", "bogus"]) == EX_USAGE
    assert main([str(tmp_path), str(tmp_path / "m"), "-t", "nfs"]) == EX_USAGE
    assert main([str(tmp_path), str(tmp_path / "m"), "-N", "/proc/1/ns/mnt"]) == EX_USAGE
    assert main([str(tmp_path / "missing"), str(tmp_path / "m"), "-f"]) == EX_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mount.cachefs: error: unknown option 'bogus'",
                   "mount.cachefs: error: filesystem type 'nfs' is not cachefs",
                   "mount.cachefs: error: -N (mount in another namespace) is not supported; "
                   "run mount inside that namespace",
                   f"cachefs: error: source {str(tmp_path / 'missing')!r} does not exist"]


def test_fake_mode_checks_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "mnt").mkdir()
    cache = tmp_path / "cache"
    assert main([str(tmp_path / "src"), str(tmp_path / "mnt"), "-f", "-v", "-o",
                 f"cache_dir={cache},ram_size=64MiB,disk_size=64MiB"]) == 0
    out = capsys.readouterr()
    assert "check passed: would mount" in out.out and "--ram-size 64MiB" in out.err
    assert not cache.exists()


def test_a_shared_cache_option_with_several_servers():
    options = split_options("ro,shared_cache=memcached://10.0.0.1:11211+10.0.0.2:11211,shared_namespace=imagenet")
    args, warnings = translate(options)
    assert args == ["--shared-cache", "memcached://10.0.0.1:11211+10.0.0.2:11211", "--shared-namespace", "imagenet"]
    assert not warnings
    from cachefs.cli import build_parser

    parsed = build_parser().parse_args(["mount", "s", "m", *args])
    assert parsed.shared_cache.endswith("10.0.0.2:11211")
