"""The demonstration model and data that ship with zcore."""
