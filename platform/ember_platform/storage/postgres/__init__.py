"""The PostgreSQL state store's connection: the same tables and migrations as SQLite's."""
