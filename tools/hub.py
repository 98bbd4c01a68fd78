"""The local Hugging Face hub of the online tests, from the command line (docs/hub_fixture.md).

    python tools/hub.py build --dir DIR
    python tools/hub.py serve --dir DIR [--port 8090] [--stand-ins all|MODEL ...] [--overlay FILE]

Run as a script, Python puts this folder (tools/) first on the path, so :mod:`kpca_tools`
imports with nothing installed or set; ``kpca_repro`` comes from the install or PYTHONPATH.
"""

import sys

from kpca_tools.hub.fixture import main

if __name__ == "__main__":
    sys.exit(main())
