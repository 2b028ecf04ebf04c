"""Writing checkpoints: the atomic sharded-state saver and the converter."""
