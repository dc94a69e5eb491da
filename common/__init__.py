"""Code shared by the manager, the workers and the clients."""
