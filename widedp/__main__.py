"""``python -m widedp ...`` and ``torchrun -m widedp ...``: the ``widedp`` command line (``widedp.cli``)."""

import sys

from widedp.cli import main

if __name__ == "__main__":
    sys.exit(main())
