"""The options of `cachefs mount` are declared once (cachefs/options.py): the table, the
parser built from it, Config's fields, the names mount.cachefs -o accepts and the README's
options table all agree."""

import argparse
import pathlib
import re

from cachefs.cli import build_parser
from cachefs.mounthelper import _mount_options
from cachefs.options import MOUNT_OPTIONS, config_fields, config_from

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _mount_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["mount"]


def test_every_config_field_is_set_by_exactly_one_option():
    fields = [o.field for o in MOUNT_OPTIONS if o.field is not None]
    assert len(fields) == len(set(fields)), "two options set one field"
    assert set(fields) == config_fields()


def test_the_parser_and_mount_helper_know_exactly_the_table():
    flags = {f for o in MOUNT_OPTIONS for f in o.flags}
    parsed = {f for a in _mount_parser()._actions for f in a.option_strings} - {"-h", "--help"}
    assert parsed == flags
    assert set(_mount_options()) - {"help"} == {f[2:] for f in flags if f.startswith("--")}


def test_the_readme_table_lists_every_option_and_no_other():
    text = README.read_text()
    table = text[text.index("## Options"):]
    table = table[:table.index("\n\n", table.index("| option |"))]
    rows = re.findall(r"^\| (.+?) \|", table, re.M)[1:]  # the header
    named = {f for row in rows for f in re.findall(r"`(--?[a-z-]+)", row)}
    assert {o.long for o in MOUNT_OPTIONS} <= named | {"--verbose"}, "README lacks a row"
    assert named - {"-v", "-vv", "-f"} <= {o.long for o in MOUNT_OPTIONS}, "README names an option that does not exist"


def test_the_configuration_doc_explains_every_option():
    text = (README.parent / "docs" / "configuration.md").read_text()
    missing = [o.long for o in MOUNT_OPTIONS if f"`{o.long}" not in text]
    assert not missing, f"docs/configuration.md does not explain {missing}"


def test_a_command_line_becomes_the_config_it_says():
    args = _mount_parser().parse_args(["/src", "/mnt", "--ram-size", "2GiB", "--open-per-handle", "--readahead", "file",
                                       "--shared-cache", "memcached://a:1", "-vv", "--check"])
    config = config_from(args)
    assert (config.source, config.mountpoint, config.ram_size) == ("/src", "/mnt", 2 << 30)
    assert config.zero_message_open is False and config.readahead == "file" and config.verbose == 2
    assert config.shared_cache == "memcached://a:1"
