"""The SQLite state store's connection: one file, its schema kept by `storage/migrations.py`."""
