"""The batching core: live requests, their plans, the cell-type queues, the workers' arena rows and tasks in flight
(manager.batching.core owns them); it does no I/O."""
