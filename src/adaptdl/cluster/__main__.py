"""``python -m adaptdl.cluster``: run the local cluster daemon in the foreground.

``adaptdl cluster start`` runs this in the background; see
:mod:`adaptdl.cluster._daemon` for the options.
"""

import sys

from adaptdl.cluster._daemon import main

sys.exit(main())
