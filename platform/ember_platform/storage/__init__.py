"""Where the control plane keeps things: the state store, blob stores, and blob deletes
still owed."""
