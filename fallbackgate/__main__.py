"""``python -m fallbackgate …``: the same command line as the ``fallbackgate`` script."""

from fallbackgate.cli import main

raise SystemExit(main())
