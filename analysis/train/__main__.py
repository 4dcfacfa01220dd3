"""``python -m analysis.train``: see ``analysis.train.cli``."""
from analysis.train.cli import main

raise SystemExit(main())
