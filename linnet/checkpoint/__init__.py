"""Checkpoint folders that survive a crash at any moment, for either framework: the folder of step-N
checkpoints (folder), the lock one run holds on it (lock), the disk checks (storage) and what a resume
compares (resume_check). Each wing writes its own state into them (linnet.torch.checkpoint,
linnet.jax.checkpoint)."""
