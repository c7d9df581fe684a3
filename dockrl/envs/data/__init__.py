"""The environments' bundled task files (JSONL), read by ``dockrl.envs.tasks``: a package of its own so that
setuptools ships them as its package data."""
