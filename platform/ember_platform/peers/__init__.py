"""Several control-plane processes on one PostgreSQL: the platform lease, the standby that
pipes connections to its holder, and a server's turns between the two."""
