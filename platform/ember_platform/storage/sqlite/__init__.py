"""The SQLite state store's parts: one connection, and the tables by what they keep."""
