"""Resharding between training and inference layouts, and the device layers it runs on."""
