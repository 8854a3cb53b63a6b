"""The state store's tables, by what they keep: the same SQL on SQLite and PostgreSQL,
run on the `Database` each backend gives them."""
