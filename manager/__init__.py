"""Manager process: frontend, request processor, scheduler, slot allocator."""
