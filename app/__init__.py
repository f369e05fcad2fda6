"""steprecord: one durable, database-guarded record per step of a process instance."""
