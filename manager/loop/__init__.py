"""The manager's event loop and its sockets: clients, workers, and the manager process around them."""
