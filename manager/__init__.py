"""The manager: the batching core (`batching`), its event loop and sockets (`loop`), what it reports of
itself (`observability`), and the `batchmaker` command with the supervisor (`commands`)."""
