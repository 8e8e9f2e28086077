"""Hugging Face checkpoints in and out: reading SafeTensors folders a slice at a time (read) and writing
them a group at a time, with the index and config (write)."""
