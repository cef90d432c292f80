"""The training loop above ``Peer``: the synchronous trainer (``synchronous.py``, behind
``gossip.train``), the asynchronous runner, the metrics records, the consensus probe and an
asynchronous run's snapshots. Import the module that holds a name; this face imports nothing,
so the command line starts without torch."""
