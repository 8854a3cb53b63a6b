"""Commands on shared state: ember dict, ember queue, ember volume."""
