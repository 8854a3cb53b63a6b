"""Commands for operators: nodes, replicas, snapshots, tokens, secrets, usage."""
