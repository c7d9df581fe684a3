"""The dock's front end, ``DockClient`` (``dock_client.py``): the ``Dock`` API over S shards, in either
``dock.mode``. Its parts: the state and calls every part builds on (``core.py``), cells (``cells.py``),
puts (``puts.py``), claims (``claims.py``), snapshots and counters (``snapshots.py``), and the lease
heartbeat (``heartbeat.py``)."""
