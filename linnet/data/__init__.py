"""Training data: examples packed into rows (packing), and the synthetic instruction tasks that the
tiny cards and the offline quick start train on (synthetic_tasks)."""
