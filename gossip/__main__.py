"""`python -m gossip`."""

import gc

from gossip.cli import main

try:
    main()
finally:
    # The interpreter's last collections walk every object torch and its compiler stack
    # made: about a second of CPU for each peer process at exit, while its files and
    # sockets are closed already. Frozen objects are left to the exit itself.
    gc.freeze()
