"""``python -m asyncrl`` is the same as the ``asyncrl`` console script."""

from workers.cli import main  # the one upward import: `python -m asyncrl` is an entry point

raise SystemExit(main())
