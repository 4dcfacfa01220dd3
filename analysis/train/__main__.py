"""``python -m analysis.train [sweep] ...``: the alias of ``sinklens train`` / ``sinklens sweep`` (see
``analysis.train.cli``)."""

from analysis.train.cli import main

raise SystemExit(main())
