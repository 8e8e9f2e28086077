"""Linnet: fully sharded fine-tuning of Llama-family models."""
