"""README's headline block from a recorded run, from the command line (tools/kpca_tools/headline.py).

    python tools/headline.py docs/runs/<name> --readme README.md

Run as a script, Python puts this folder (tools/) first on the path, so :mod:`kpca_tools`
imports with nothing installed or set; ``kpca_repro`` comes from the install or PYTHONPATH.
"""

import sys

from kpca_tools.headline import main

if __name__ == "__main__":
    sys.exit(main())
