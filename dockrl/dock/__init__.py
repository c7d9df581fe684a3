"""The transfer dock: the experience table through which stages exchange columns (docs/design.md §2)."""

from dockrl.dock.api import Claim, Dock, StageDock
from dockrl.dock.client.dock_client import open_dock
from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.schema import GRPO_SCHEMA, Column, Schema

__all__ = ["Claim", "Column", "Dock", "DockError", "DockTimeoutError", "GRPO_SCHEMA", "Schema", "StageDock", "open_dock"]
