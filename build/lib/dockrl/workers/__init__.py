"""Stage loops: each claims rows from the dock, computes, and puts its columns back."""
