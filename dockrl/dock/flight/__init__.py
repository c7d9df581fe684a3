"""Dock shards over Arrow Flight (``dock.mode=distributed``): starting shard processes (``shards.py``), the
shard's server (``server.py``), the front end's transport (``transport.py``) and the messages (``wire.py``)."""
