"""Stage loops: each claims rows from the dock, computes, and puts its columns back.

``main.py`` runs one stage as its own process against a networked dock (``dock.mode=distributed``).
"""
