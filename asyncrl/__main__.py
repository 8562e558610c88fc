"""``python -m asyncrl`` is the same as the ``asyncrl`` console script."""

from asyncrl.cli import main

raise SystemExit(main())
