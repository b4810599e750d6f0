"""Imports every shipped pass module so that each registers itself."""
