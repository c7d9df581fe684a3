"""User code and untrusted programs, each in a child process: a user's ``module:Class`` imported by its path
(``user_code.py``; the custom scorers and user environments build it in a spawned child) and the sandbox that runs a
Python program under CPU, wall, memory, process and output limits (``sandbox.py``, booted by ``sandbox_boot.py``),
here or in a sandbox executor of its own that runs it for stages elsewhere (``executor.py``; ``runner.py`` chooses, by
``env.sandbox.backend``). Below ``envs`` and ``rewards``: both use it, neither needs the other for it."""
