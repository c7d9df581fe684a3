"""One dock shard: the service whatever carries its calls (``service.py``), its iterations
(``iterations.py``), the controller of one iteration (``controller.py`` over ``controller_core.py``, with
its table ``iteration.py``, ``records.py``, ``leases.py``, ``waiters.py`` and ``controller_snapshot.py``),
the row layout of the shards (``layout.py``), the requests as records (``requests.py``), the transport
protocol and its in-process transport (``transport.py``) and the kept rollouts it writes
(``kept_rollouts.py``)."""
