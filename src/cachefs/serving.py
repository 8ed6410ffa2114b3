"""The serving processes' entry point (cachefs/fuse/serve.py's loop) with table nodes: the
FUSE layer knows nothing of the tiers, so this module, above both, hands the loop the NVMe
tier's entry table as the tiers read it (tiers/table.py, `Mapped`)."""

from __future__ import annotations

from cachefs.fuse import serve
from cachefs.tiers.table import Mapped

# What a serving process runs (python -c). Not `-m`: cachefs.fuse imports serve.py first,
# and runpy then ran it a second time as __main__, with a RuntimeWarning at every start.
SERVE_MAIN = "from cachefs.serving import main; raise SystemExit(main())"


def main(argv: list[str] | None = None) -> int:
    return serve.main(argv, rows_from=Mapped)
